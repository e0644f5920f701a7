"""The analytic CLI's table: its figures in units people read (ms, GB, TFLOP, k tokens), grouped, with
the cache's saving in FLOPs set against its saving in time on top. Only formats: every number comes
from the figures dict (`format=json` prints the same figures as exact SI numbers).
"""
from __future__ import annotations

import math
from typing import Any, Callable

from harness.analysis.capacity import PLANNING_BATCHES

SI_PREFIXES = ("", "k", "M", "G", "T", "P", "E", "Z", "Y")  # bytes and FLOPs: decimal, as datasheets state memory
COUNT_PREFIXES = ("", "k", "M", "B", "T")  # counts as model cards write them: 70B parameters, 15T tokens
YEAR_S = 365.25 * 86400
# (below this many seconds, unit, seconds per unit): the first that applies
DURATIONS = ((1e-6, "ns", 1e-9), (1e-3, "µs", 1e-6), (1.0, "ms", 1e-3), (3600.0, "s", 1.0), (2 * 86400.0, "h", 3600.0),
             (1000 * 86400.0, "days", 86400.0))


def scaled(value: float, unit: str, prefixes: tuple[str, ...] = SI_PREFIXES, space: str = "") -> str:
    """`value` in 4 significant digits under the largest prefix that leaves at least 1 before the point
    (`space` between prefix and unit: '' for GB, ' ' for '430.6 k tokens')."""
    if value == 0:
        return f"0 {unit}"
    if abs(value) >= 1000 ** len(prefixes):  # past the last prefix, plain scientific reads better
        return f"{value:.4g} {unit}"
    step = min(max(math.floor(math.log10(abs(value)) / 3), 0), len(prefixes) - 1)
    prefix = prefixes[step]
    return f"{value / 1000 ** step:,.4g} {prefix}{space if prefix else ''}{unit}"


def duration(seconds: float) -> str:
    for below, unit, size in DURATIONS:
        if seconds < below:
            return f"{seconds / size:,.4g} {unit}"
    return f"{seconds / YEAR_S:,.4g} years"


def count(noun: str) -> Callable[[Any], str]:
    return lambda value: scaled(value, noun, COUNT_PREFIXES, " ")


def exact_count(noun: str) -> Callable[[Any], str]:
    """An integer a plan answers with, exact, and its rounded size when large: 1,327,130 tokens (1.327 M)."""
    def text(value: int) -> str:
        rounded = scaled(value, "", COUNT_PREFIXES).strip()
        return f"{value:,} {noun}" + (f" ({rounded})" if value >= 10_000 else "")
    return text


def unit(name: str) -> Callable[[Any], str]:
    return lambda value: scaled(value, name)


def plain(name: str) -> Callable[[Any], str]:
    return lambda value: f"{value:,.4g} {name}"


# figure -> how the table writes it, in table order within the section named before its keys
SECTIONS: dict[str, dict[str, Callable[[Any], str]]] = {
    "decode at the roof": {
        "decode_step_s": duration, "decode_step_bound": str, "decode_intensity_flops_per_byte": plain("FLOP/B"),
        "ridge_flops_per_byte": plain("FLOP/B"), "generate_s_cached": duration, "generate_s_no_cache": duration,
        "prefill_s": duration, "decode_tokens_per_s": count("tokens/s"),
        "usd_per_million_tokens": lambda usd: f"${usd:,.4g} per million generated tokens",
    },
    "memory": {
        "weight_bytes_per_device": unit("B"), "kv_bytes_per_token_per_device": unit("B/token"),
        "kv_cache_bytes_per_device": unit("B"), "device_memory_bytes": unit("B"), "reserve_bytes_per_device": unit("B"),
        "fits": str, "max_tokens": exact_count("tokens"), "max_batch": exact_count("sequences"),
        "max_context": exact_count("tokens"),
        **{f"max_context_batch_{b}": exact_count("tokens") for b in PLANNING_BATCHES},
    },
    "model": {
        "params": count("parameters"), "weight_bytes": unit("B"), "kv_bytes_per_token": unit("B/token"),
        "kv_cache_bytes": unit("B"), "tokens_to_match_weights": count("tokens"),
    },
    "work": {
        "flops_decode_step": unit("FLOP"), "flops_decode_step_per_device": unit("FLOP"),
        "flops_decode_step_no_cache": unit("FLOP"), "flops_generate_cached": unit("FLOP"),
        "flops_generate_no_cache": unit("FLOP"), "flops_prefill": unit("FLOP"), "bytes_decode_step": unit("B"),
        "bytes_decode_step_per_device": unit("B"), "bytes_decode_step_no_cache": unit("B"),
        "prefill_bytes_per_token": unit("B/token"), "decode_bytes_per_token": unit("B/token"),
    },
    "roof of one device": {"peak_flops": unit("FLOP/s"), "bandwidth_Bps": unit("B/s")},
    "what compressing the cache can buy": {
        "kept_tokens_per_sequence": count("tokens"), "layers_stored": plain("layers"),
        "key_channels_stored": plain("channels per KV head"), "cache_share_of_step_bytes": lambda share: f"{share:.1%}",
        "step_bytes_ratio_to_exact": plain("x"), "context_to_match_weights": count("tokens"),
        "context_to_match_weights_exact": count("tokens"),
    },
}


# memory figures that need no device memory: what the split puts on each device
MEMORY_KNOWN_WITHOUT_DEVICE = ("weight_bytes_per_device", "kv_bytes_per_token_per_device", "kv_cache_bytes_per_device",
                               "device_memory_bytes")


def _notes(figures: dict, inputs: dict) -> dict[str, str]:
    """What a figure is for, where the key alone does not say (the point it was asked at)."""
    tokens = inputs["ctx"] + inputs["decode_tokens"]
    notes = {"kv_cache_bytes_per_device": f"batch {inputs['batch']:,} x {tokens:,} tokens",
             "max_tokens": "batch x tokens, any split", "max_batch": f"of {tokens:,} tokens each: ctx + decode_tokens",
             "max_context": f"per sequence at batch {inputs['batch']:,}",
             "decode_step_s": f"first step, context {inputs['ctx']:,}",
             "flops_decode_step_per_device": f"tp {inputs['tp']}", "bytes_decode_step_per_device": f"tp {inputs['tp']}",
             "cache_share_of_step_bytes": "the most any compression of this cache saves of a step",
             "context_to_match_weights": f"per sequence at batch {inputs['batch']:,}, as this layout stores it",
             "context_to_match_weights_exact": f"per sequence at batch {inputs['batch']:,}, exact cache"}
    return {**notes, **{f"max_context_batch_{b}": f"per sequence at batch {b}" for b in PLANNING_BATCHES}}


def _fits(figures: dict) -> str:
    weights, cache, reserve, memory = (scaled(figures[key], "B") for key in (
        "weight_bytes_per_device", "kv_cache_bytes_per_device", "reserve_bytes_per_device", "device_memory_bytes"))
    return f"{'yes' if figures['fits'] else 'no'}: {weights} weights + {cache} cache + {reserve} reserve, of {memory}"


def _missing(key: str, figures: dict, inputs: dict) -> str:
    """What a None figure means: no memory known, no cache to grow, or no price given."""
    if key == "usd_per_million_tokens":
        return "- (usd_per_device_hour=<price> gives one)"
    if key == "device_memory_bytes":
        return (f"not known: hardware={inputs['hardware']} states no memory_bytes, so neither what fits "
                "(hardware.memory_bytes=<bytes> sets one)")
    if key in SECTIONS["memory"]:
        return "any: without a cache nothing grows with the tokens"
    if key == "context_to_match_weights" and figures.get("kept_tokens_per_sequence") is not None:
        return "never: the token budget keeps the cache below the weights at any length"
    return "- (no cache)"


def _speedup(figures: dict, inputs: dict) -> list[str]:
    """The cache's saving in FLOPs against its saving in time, over the decode steps."""
    flops = figures["flops_generate_no_cache"] / figures["flops_generate_cached"]
    seconds = figures["generate_s_no_cache"] / figures["generate_s_cached"]
    return [f"cache speedup over the {inputs['decode_tokens']:,} decode steps (no cache / cached)",
            f"  in FLOPs  {flops:,.4g}x  ({scaled(figures['flops_generate_no_cache'], 'FLOP')} / "
            f"{scaled(figures['flops_generate_cached'], 'FLOP')})",
            f"  in time   {seconds:,.4g}x  ({duration(figures['generate_s_no_cache'])} / "
            f"{duration(figures['generate_s_cached'])}; the cached step is {figures['decode_step_bound']} bound)"]


def header(inputs: dict) -> str:
    price = inputs.get("usd_per_device_hour")
    return (f"# {inputs['model']} on {inputs['roof_source']}; {inputs['dtype']}, batch {inputs['batch']:,}, "
            f"ctx {inputs['ctx']:,}, decode_tokens {inputs['decode_tokens']:,}, tp {inputs['tp']}"
            + (f", ${price:,.4g} per device-hour" if price is not None else ""))


def render_table(figures: dict, inputs: dict) -> str:
    """The figures as text: a header, the speedup, then one block per section (every figure once)."""
    notes = _notes(figures, inputs)
    formats = {key: write for section in SECTIONS.values() for key, write in section.items()}
    sections = {title: [k for k in keys if k in figures] for title, keys in SECTIONS.items()}
    sections["other"] = [k for k in figures if k not in formats]  # a figure no section names yet
    if inputs["tp"] == 1:  # one device's share is the whole step: said once
        sections["work"] = [k for k in sections["work"] if not k.endswith("_per_device")]
    unknown_memory = figures.get("device_memory_bytes", 0) is None
    needs_memory = set(sections["memory"]) - set(MEMORY_KNOWN_WITHOUT_DEVICE) if unknown_memory else set()
    width = max(len(k) for k in figures)
    lines = [header(inputs), "", *_speedup(figures, inputs)]
    for title, keys in sections.items():
        if not keys:
            continue
        if title == "memory":
            title = (f"memory per device: {inputs['tp']} x {inputs['hardware']}, "
                     f"{inputs['reserve'] * 100:.4g}% of each kept for activations (reserve)")
        lines += ["", title]
        for key in keys:
            value = figures[key]
            if value is None and key in needs_memory:
                continue  # said once, on device_memory_bytes
            if value is None:
                text = _missing(key, figures, inputs)
            elif key == "fits":
                text = _fits(figures)
            else:
                text = formats.get(key, str)(value)
                text += f"  ({notes[key]})" if key in notes else ""
            lines.append(f"  {key:<{width}}  {text}")
    return "\n".join(lines)

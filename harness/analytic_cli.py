"""`python -m harness.analytic`: the analytic model's figures for one workload, as JSON or a table.

    python -m harness.analytic model=llama3_70b hardware=h100_sxm dtype=bfloat16 batch=1 ctx=4096 \
        decode_tokens=512 format=json

Composes conf/analytic.yaml with Hydra's compose API (no job, no output folder), so `model=llama3_8b
model.n_layers=1` works as in the runner. Bad input prints one line `<key>: <what is allowed>` on stderr
and exits 2, never a traceback.
"""
from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from harness import analytic
from harness.config import ModelConfig, model_config_from
from harness.hardware import HardwareError, hardware_from_mapping, resolve

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"
FORMATS = ("table", "json")


@dataclass
class HardwareSchema:
    """Fields of conf/hardware/*.yaml (see harness.hardware.Hardware)."""

    name: str = "h100_sxm"  # config name
    bandwidth_Bps: Optional[float] = None  # bytes/s; null for `measured` until a calibration fills it
    flops: dict[str, float] = field(default_factory=dict)  # dtype -> peak dense FLOP/s
    source: str = ""  # where the figures come from
    calibrated: bool = False  # figures come from a calibration record


@dataclass
class AnalyticConfig:
    """One workload for the analytic model (conf/analytic.yaml)."""

    model: ModelConfig = field(default_factory=ModelConfig)  # decoder shape (conf/model/)
    hardware: HardwareSchema = field(default_factory=HardwareSchema)  # device roofs (conf/hardware/)
    dtype: str = "bfloat16"  # float32 | bfloat16 | float16
    batch: int = 1  # sequences decoded together
    ctx: int = 4096  # prompt tokens: the context of the first decode step
    decode_tokens: int = 512  # decode steps after the prompt
    format: str = "table"  # table | json
    results_dir: str = "results"  # where hardware=measured finds its calibration record
    device: Optional[str] = None  # hardware=measured: cpu | cuda, or null for any record


class UsageError(ValueError):
    """Bad input; the message is the one line printed."""


# key -> unit, in the order printed. The README section defines each key.
UNITS = {
    "params": "parameters",
    "weight_bytes": "B",
    "kv_bytes_per_token": "B/token",
    "kv_cache_bytes": "B",
    "tokens_to_match_weights": "tokens",
    "flops_decode_step": "FLOP",
    "flops_decode_step_no_cache": "FLOP",
    "flops_generate_cached": "FLOP",
    "flops_generate_no_cache": "FLOP",
    "flops_prefill": "FLOP",
    "bytes_decode_step": "B",
    "bytes_decode_step_no_cache": "B",
    "decode_step_s": "s",
    "decode_step_bound": "",
    "generate_s_cached": "s",
    "generate_s_no_cache": "s",
    "prefill_s": "s",
    "prefill_bytes_per_token": "B/token",
    "decode_bytes_per_token": "B/token",
    "ridge_flops_per_byte": "FLOP/B",
    "decode_intensity_flops_per_byte": "FLOP/B",
    "peak_flops": "FLOP/s",
    "bandwidth_Bps": "B/s",
}


def _options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


def _check_overrides(overrides: list[str]) -> None:
    """Name an unknown model=/hardware= choice with the allowed ones (Hydra's own message is a page),
    and the override Hydra cannot parse (its own message does not say which)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    for override in overrides:
        key, sep, value = override.partition("=")
        if sep and key in ("model", "hardware") and value not in _options(key):
            raise UsageError(f"{key}: unknown '{value}', allowed: {', '.join(_options(key))}")
        if not sep:
            raise UsageError(f"{override}: expected key=value, keys: {', '.join(AnalyticConfig.__dataclass_fields__)}")
        try:
            parser.parse_override(override)
        except Exception:  # OverrideParseException: the grammar's message names no key
            raise UsageError(f"{key}: cannot parse '{value}' (Hydra override syntax: key=value)") from None


def compose(overrides: list[str]):
    """The composed config, or UsageError with Hydra's complaint reduced to one line."""
    from hydra import compose as hydra_compose, initialize_config_dir
    from hydra.core.config_store import ConfigStore
    from hydra.core.global_hydra import GlobalHydra

    _check_overrides(overrides)
    ConfigStore.instance().store(name="analytic_schema", node=AnalyticConfig)
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3", job_name="analytic"):
            return hydra_compose(config_name="analytic", overrides=overrides)
    except Exception as error:  # Hydra and OmegaConf raise many types; all mean bad input here
        raise UsageError(_one_line(error)) from None


def _one_line(error: Exception) -> str:
    """Hydra's complaint as `<key>: <what is allowed>`, from the error and its cause."""
    text = str(error)
    first = text.strip().splitlines()[0] if text.strip() else type(error).__name__
    unknown = re.match(r"Could not override '([^']+)'", first)
    if unknown:
        key = unknown.group(1)
        parent, _, _ = key.rpartition(".")
        return f"{key}: unknown key, allowed: {', '.join(_fields(parent))}"
    merging = re.match(r"Error merging override ([^=]+)=(.*)", first)
    if merging and error.__cause__ is not None:
        cause = str(error.__cause__).strip().splitlines()[0]
        return f"{merging.group(1)}: {cause}"
    return first


def _fields(parent: str) -> list[str]:
    """Keys allowed under `parent` ('' for the top level) of the analytic schema."""
    schema = {"": AnalyticConfig, "model": ModelConfig, "hardware": HardwareSchema}.get(parent, AnalyticConfig)
    return list(schema.__dataclass_fields__)


def workload(cfg) -> tuple[ModelConfig, analytic.Roof, str]:
    """Check what a type cannot express and resolve the roof."""
    shape = model_config_from(cfg.model)
    for key in ("batch", "ctx", "decode_tokens"):
        if cfg[key] < 1:
            raise UsageError(f"{key}: must be a positive integer, got {cfg[key]}")
    for key in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "ffn_dim"):
        if getattr(shape, key) < 1:
            raise UsageError(f"model.{key}: must be a positive integer, got {getattr(shape, key)}")
    if shape.n_heads % shape.n_kv_heads:
        raise UsageError(f"model.n_kv_heads: must divide n_heads ({shape.n_heads}), got {shape.n_kv_heads}")
    if shape.resolved_head_dim < 1:
        raise UsageError(f"model.head_dim: must be positive, got {shape.resolved_head_dim}")
    if cfg.format not in FORMATS:
        raise UsageError(f"format: unknown '{cfg.format}', allowed: {', '.join(FORMATS)}")
    try:
        roof, source = resolve(hardware_from_mapping(cfg.hardware), cfg.dtype, cfg.results_dir, cfg.device)
    except HardwareError as error:
        raise UsageError(str(error)) from None
    return shape, roof, source


def _human(value: Any, unit: str) -> str:
    """A value for the table: integers with thousands separators, floats in 4 significant digits."""
    if isinstance(value, str):
        return value
    if isinstance(value, int):
        text = f"{value:,}"
    else:
        text = f"{value:.4g}"
    if unit:
        text += f" {unit}"
    if unit == "B" and value >= 1024:
        text += f" ({_binary(value)})"
    return text


def _binary(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.4g} {unit}"
        n /= 1024
    return f"{n:.4g} TiB"


def render_table(figures: dict, header: str) -> str:
    width = max(len(k) for k in figures)
    lines = [header]
    for key, value in figures.items():
        unit = UNITS.get(key, "")
        lines.append(f"{key:<{width}}  {_human(value, unit)}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    try:
        cfg = compose(argv)
        shape, roof, source = workload(cfg)
    except UsageError as error:
        print(error, file=sys.stderr)
        return 2
    figures = analytic.summary(shape, cfg.dtype, cfg.batch, cfg.ctx, cfg.decode_tokens, roof)
    if cfg.format == "json":
        inputs = {"model": shape.name, "hardware": cfg.hardware.name, "roof_source": source, "dtype": cfg.dtype,
                  "batch": cfg.batch, "ctx": cfg.ctx, "decode_tokens": cfg.decode_tokens}
        print(json.dumps({**inputs, **figures}, indent=2))
    else:
        header = (f"# {shape.name} on {source}; {cfg.dtype}, batch {cfg.batch}, ctx {cfg.ctx}, "
                  f"decode_tokens {cfg.decode_tokens}")
        print(render_table(figures, header))
    return 0

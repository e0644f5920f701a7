"""`python -m harness.analysis`: the analytic model's figures for one workload, as JSON or a table.

    python -m harness.analysis model=llama3_70b hardware=h100_sxm dtype=bfloat16 batch=1 ctx=4096 \
        decode_tokens=512 format=json

Composes conf/analytic.yaml with Hydra's compose API (no job, no output folder), so `model=llama3_8b
model.n_layers=1` works as in the runner. Bad input prints one line `<key>: <what is allowed>` on stderr
and exits 2, never a traceback.
"""
from __future__ import annotations

import dataclasses
import json
import math
import re
import sys
from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import OmegaConf

from harness.analysis import analytic
from harness.analysis.hardware import Hardware, HardwareError, resolve
from harness.config import ConfigError, ModelConfig, model_config_from
from harness.config.paths import config_dir
from harness.config.validate import bounded_tree, class_path, one_of, safe_name, validate_workload

CONF_DIR = config_dir()
FORMATS = ("table", "json")


@dataclass
class AnalyticConfig:
    """One workload for the analytic model (conf/analytic.yaml)."""

    model: ModelConfig  # decoder shape: a preset of conf/model/
    hardware: Hardware  # device roofs: a datasheet of conf/hardware/, or measured
    strategy: Any = field(default_factory=dict)  # whose cache layout the cached figures use (conf/strategy/)
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
        if sep and key in ("model", "hardware", "strategy") and value not in _options(key):
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
    schema = {"": AnalyticConfig, "model": ModelConfig, "hardware": Hardware}.get(parent, AnalyticConfig)
    return [f.name for f in dataclasses.fields(schema)]


def cache_layout(strategy, shape):
    """The layout of the configured strategy for `shape` (the class is imported by its `_target_`, as
    Hydra would)."""
    from hydra.utils import get_class

    options = {k: v for k, v in strategy.items() if k != "_target_"}
    try:
        class_path("strategy._target_", strategy.get("_target_"))  # one line, not Hydra's logged three
        return get_class(strategy["_target_"])(**options).cache_layout(shape)
    except ConfigError as error:
        raise UsageError(str(error)) from None
    except Exception as error:  # a bad _target_: ImportError, AttributeError, TypeError for an unknown option
        raise UsageError(f"strategy: {str(error).splitlines()[0]}") from None


def workload(cfg) -> tuple[ModelConfig, analytic.Roof, str, object]:
    """Check what a type cannot express (the runner's own checks), resolve the roof and the layout."""
    try:
        validate_workload(cfg)
        one_of("format", cfg.format, FORMATS)
        safe_name("hardware.name", cfg.hardware.name)
        if not str(cfg.results_dir).strip():
            raise ConfigError("results_dir", "is empty: name the folder whose _calibration/ hardware=measured reads")
        bounded_tree(OmegaConf.to_container(cfg, resolve=True))  # every other number: int64, finite
    except ConfigError as error:
        raise UsageError(str(error)) from None
    shape = model_config_from(cfg.model)
    hardware = OmegaConf.to_object(cfg.hardware)
    try:
        roof, source = resolve(hardware, cfg.dtype, cfg.results_dir, cfg.device)
    except HardwareError as error:
        raise UsageError(str(error)) from None
    return shape, roof, source, cache_layout(OmegaConf.to_container(cfg.strategy, resolve=True), shape)


def _human(value: Any, unit: str) -> str:
    """A value for the table: integers with thousands separators, floats in 4 significant digits."""
    if isinstance(value, str):
        return value
    if value is None:
        return "– (no cache)"
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


def finite_figures(figures: dict) -> dict:
    """The figures, each a finite number (or a string, or None for no cache): JSON has no NaN, and a
    table of inf tells nothing. The inputs are bounded (validate_workload, Hardware.roof), so this only
    guards the arithmetic."""
    for key, value in figures.items():
        if isinstance(value, float) and not math.isfinite(value):
            raise UsageError(f"{key}: the analytic model gives {value} for these inputs; choose smaller sizes "
                             "or other roofs")
    return figures


def main(argv: list[str]) -> int:
    try:
        cfg = compose(argv)
        shape, roof, source, layout = workload(cfg)
    except UsageError as error:
        print(error, file=sys.stderr)
        return 2
    try:
        figures = finite_figures(analytic.summary(shape, cfg.dtype, cfg.batch, cfg.ctx, cfg.decode_tokens, roof, layout))
    except ArithmeticError as error:  # OverflowError, ZeroDivisionError: inputs the bounds let through
        print(f"hardware: the analytic model cannot be evaluated for these inputs ({type(error).__name__}: {error})",
              file=sys.stderr)
        return 2
    except UsageError as error:
        print(error, file=sys.stderr)
        return 2
    if cfg.format == "json":
        inputs = {"model": shape.name, "strategy": cfg.strategy._target_.rsplit(".", 1)[-1], "hardware": cfg.hardware.name, "roof_source": source, "dtype": cfg.dtype,
                  "batch": cfg.batch, "ctx": cfg.ctx, "decode_tokens": cfg.decode_tokens}
        print(json.dumps({**inputs, **figures}, indent=2, allow_nan=False))
    else:
        header = (f"# {shape.name} on {source}; {cfg.dtype}, batch {cfg.batch}, ctx {cfg.ctx}, "
                  f"decode_tokens {cfg.decode_tokens}")
        print(render_table(figures, header))
    return 0

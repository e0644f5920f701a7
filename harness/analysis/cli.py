"""`python -m harness.analysis`: the analytic model's figures for one point, as JSON or a table.

    python -m harness.analysis model=llama3_70b hardware=h100_sxm dtype=bfloat16 batch=1 ctx=4096 \
        decode_tokens=512 format=json

Composes conf/analytic.yaml with Hydra's compose API (no job, no output folder), so `model=llama3_8b
model.n_layers=1` works as in the runner. `--help` lists every key (harness.analysis.usage). The figures
come from the analytic model (analytic.summary, split over `tp` devices by harness.analysis.capacity,
with its capacity plan and cost); this module checks the input and prints them: as a table
(harness.analysis.table) or as JSON of exact SI numbers. Bad input prints one line
`<key>: <what is allowed>` on stderr and exits 2, never a traceback.
"""
from __future__ import annotations

import dataclasses
import json
import math
import re
import sys
from dataclasses import dataclass, field
from typing import Any, Optional

from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf

from harness.analysis import capacity, compression
from harness.analysis.analytic import Roof
from harness.analysis.capacity import DEFAULT_RESERVE
from harness.analysis.hardware import Hardware, HardwareError, resolve
from harness.analysis.table import render_table
from harness.analysis.usage import GROUPS, usage
from harness.config import ConfigError, ModelConfig, model_config_from
from harness.config.paths import config_dir
from harness.config.overrides import (chosen_option, composition_refusal, named_options, parsed_overrides,
                                      strategy_option_refusal, unknown_option)
from harness.config.validate import (bounded_tree, first_line, interpolations_resolve, known_keys,
                                     one_of, positive_float, safe_name, target_class, validate_sizes)

CONF_DIR = config_dir()
FORMATS = ("table", "json")
HELP_FLAGS = ("--help", "-h")
MEMORY_BOUNDS = (1.0, 1e18)  # bytes of one device: far beyond any, and every capacity figure stays finite
PRICE_BOUNDS = (1e-6, 1e6)  # USD per device-hour: a millionth of a cent to a million dollars


@dataclass
class AnalyticConfig:
    """One point for the analytic model (conf/analytic.yaml)."""

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
    tp: int = 1  # devices the model is split over (tensor parallel); KV heads replicated past n_kv_heads
    reserve: float = DEFAULT_RESERVE  # share of each device's memory kept for activations, 0 to below 1
    usd_per_device_hour: Optional[float] = None  # rental price of one device; null: no cost per million tokens


class UsageError(ValueError):
    """Bad input; the message is the one line printed."""


def _options(group: str) -> list[str]:
    return named_options(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


def _check_overrides(overrides: list[str]) -> None:
    """Each override readable by Hydra, a group given one of its options (Hydra's own message for an
    unknown one is a page): harness.config.overrides, as for the runner."""
    parser = OverridesParser.create()
    try:
        for override in parsed_overrides(parser, overrides, GROUPS, _options, sweeps=False,
                                         usage=f" (--help lists them), keys: {', '.join(AnalyticConfig.__dataclass_fields__)}",
                                         schema=AnalyticConfig):
            group, value = override.key_or_group, None if override.is_delete() else override.value()
            option = value if isinstance(value, str) else override.get_value_element_as_str()  # null, 1 as written
            if group in GROUPS and value is not None and option not in _options(group):
                raise unknown_option(group, option, _options(group))
    except ConfigError as error:
        raise UsageError(str(error)) from None


def compose(overrides: list[str]):
    """The composed config, or UsageError with Hydra's complaint reduced to one line."""
    _check_overrides(overrides)
    ConfigStore.instance().store(name="analytic_schema", node=AnalyticConfig)
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3", job_name="analytic"):
            cfg = hydra_compose(config_name="analytic", overrides=overrides)
    except Exception as error:  # Hydra and OmegaConf raise many types; all mean bad input here
        said = _one_line(error)
        option = strategy_option_refusal(said.split(":", 1)[0], overrides, compose)
        raise UsageError(str(option) if option else said) from None
    try:
        interpolations_resolve(cfg)  # every ${...} resolves before a value is read
    except ConfigError as error:
        raise UsageError(str(error)) from None
    return cfg


def _one_line(error: Exception) -> str:
    """Hydra's complaint as `<key>: <what is allowed>`, from the error and its cause."""
    first = first_line(error, typed=False)
    unknown = re.match(r"Could not override '([^']+)'", first)
    if unknown:
        key = unknown.group(1)
        parent, _, _ = key.rpartition(".")
        return f"{key}: unknown key, allowed: {', '.join(_fields(parent))}"
    said = composition_refusal(error, sweeps=False)
    if said:
        return str(said)
    merging = re.match(r"Error merging override ([^=]+)=(.*)", first)
    if merging and error.__cause__ is not None:
        cause = first_line(error.__cause__, typed=False)
        return f"{merging.group(1)}: {cause}"
    return first


def _fields(parent: str) -> list[str]:
    """Keys allowed under `parent` ('' for the top level) of the analytic schema."""
    schema = {"": AnalyticConfig, "model": ModelConfig, "hardware": Hardware}.get(parent, AnalyticConfig)
    return [f.name for f in dataclasses.fields(schema)]


def cache_layout(strategy, shape, chosen: str | None = None):
    """The layout of the configured strategy for `shape` (the class imported from its `_target_`, built
    from its options as the runner builds it: strategies.base.Strategy.from_options); one the strategy
    cannot store at this shape is refused (its check_layout). `chosen`: the option of conf/strategy/ picked."""
    options = {k: v for k, v in strategy.items() if k != "_target_"}
    try:
        built = target_class("strategy._target_", strategy.get("_target_")).from_options(options, chosen)
        built.check_layout(shape)
        return built.cache_layout(shape)
    except ConfigError as error:
        raise UsageError(str(error)) from None
    except Exception as error:  # the class's own checks of the shape (ValueError)
        raise UsageError(f"strategy: {str(error).splitlines()[0]}") from None


def analytic_point(cfg, chosen: str | None = None) -> tuple[ModelConfig, Roof, str, object]:
    """Check what a type cannot express (the runner's own checks), resolve the roof and the layout."""
    try:
        known_keys(cfg, AnalyticConfig)  # a key added with `+` would be carried along unread
        validate_sizes(cfg)
        one_of("format", cfg.format, FORMATS)
        safe_name("hardware.name", cfg.hardware.name)
        if not str(cfg.results_dir).strip():
            raise ConfigError("results_dir", "is empty: name the folder whose _calibration/ hardware=measured reads")
        bounded_tree(OmegaConf.to_container(cfg, resolve=True))  # every other number: int64, finite
        _check_plan(cfg)
    except ConfigError as error:
        raise UsageError(str(error)) from None
    shape = model_config_from(cfg.model)
    hardware = OmegaConf.to_object(cfg.hardware)
    try:
        roof, source = resolve(hardware, cfg.dtype, cfg.results_dir, cfg.device)
    except HardwareError as error:
        raise UsageError(str(error)) from None
    return shape, roof, source, cache_layout(OmegaConf.to_container(cfg.strategy, resolve=True), shape, chosen)


def _check_plan(cfg) -> None:
    """The capacity plan's keys: a split the heads allow, a reserve below the whole memory, a price
    and a memory that are positive and bounded (so every figure stays finite)."""
    why = capacity.check_tp(model_config_from(cfg.model), cfg.tp)
    if why:
        raise ConfigError("tp", why)
    reserve = cfg.reserve
    if not 0 <= reserve < 1:  # finite already (bounded_tree)
        raise ConfigError("reserve", f"must be a fraction of device memory from 0 to below 1, got {reserve!r}")
    if cfg.usd_per_device_hour is not None:
        positive_float("usd_per_device_hour", cfg.usd_per_device_hour, *PRICE_BOUNDS)
    if cfg.hardware.memory_bytes is not None:
        positive_float("hardware.memory_bytes", cfg.hardware.memory_bytes, *MEMORY_BOUNDS)


def finite_figures(figures: dict) -> dict:
    """The figures, each a finite number (or a string, or None for no cache): JSON has no NaN, and a
    table of inf tells nothing. The inputs are bounded (validate_sizes, Hardware.roof), so this only
    guards the arithmetic."""
    for key, value in figures.items():
        if isinstance(value, float) and not math.isfinite(value):
            raise UsageError(f"{key}: the analytic model gives {value} for these inputs; choose smaller sizes "
                             "or other roofs")
    return figures


def figures_of(cfg, shape, roof, layout) -> dict:
    """Every figure for the composed point: the model's, split over cfg.tp devices, its capacity
    plan for the cache at the end of the generation, and its cost."""
    figures = capacity.split_summary(shape, cfg.dtype, cfg.batch, cfg.ctx, cfg.decode_tokens, roof, layout, cfg.tp)
    figures.update(capacity.capacity_figures(shape, cfg.dtype, layout, cfg.tp, cfg.batch, cfg.ctx + cfg.decode_tokens,
                                             cfg.hardware.memory_bytes, cfg.reserve))
    figures.update(capacity.cost_figures(figures["generate_s_cached"], cfg.batch, cfg.decode_tokens, cfg.tp,
                                         cfg.usd_per_device_hour))
    figures.update(compression.compression_figures(shape, cfg.dtype, cfg.batch, cfg.ctx, cfg.decode_tokens, layout))
    return finite_figures(figures)


def help_text() -> str:
    return usage(AnalyticConfig, CONF_DIR / "analytic.yaml", {group: _options(group) for group in GROUPS},
                 {"model": ModelConfig, "hardware": Hardware})


def main(argv: list[str]) -> int:
    if any(arg in HELP_FLAGS for arg in argv):
        print(help_text())
        return 0
    try:
        cfg = compose(argv)
        shape, roof, source, layout = analytic_point(cfg, chosen_option("strategy", argv))
        figures = figures_of(cfg, shape, roof, layout)
    except UsageError as error:
        print(error, file=sys.stderr)
        return 2
    except ArithmeticError as error:  # OverflowError, ZeroDivisionError: inputs the bounds let through
        print(f"hardware: the analytic model cannot be evaluated for these inputs ({type(error).__name__}: {error})",
              file=sys.stderr)
        return 2
    inputs = {"model": shape.name, "strategy": cfg.strategy._target_.rsplit(".", 1)[-1], "hardware": cfg.hardware.name,
              "roof_source": source, "dtype": cfg.dtype, "batch": cfg.batch, "ctx": cfg.ctx,
              "decode_tokens": cfg.decode_tokens, "tp": cfg.tp, "reserve": cfg.reserve,
              "usd_per_device_hour": cfg.usd_per_device_hour}
    if cfg.format == "json":
        print(json.dumps({**inputs, **figures}, indent=2, allow_nan=False))
    else:
        print(render_table(figures, inputs))
    return 0

"""Checks a composed config must pass before anything runs: one clear line per problem.

Types and unknown keys are enforced by the schemas (harness.config.schema) while Hydra composes; this
module checks values: known names, sizes that are positive and fit a 64-bit integer, shapes that can
exist, modes that fit the device. The runner and the analytic CLI call the same functions. Every
failure is a ConfigError naming the key and what is allowed. A strategy checks its own options
(strategies.base.Strategy); this module knows no strategy.
"""
from __future__ import annotations

import math
from typing import Any

DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "float32", "bfloat16", "float16")
PREFILL_MODES = ("compute", "random")
TRAFFIC_SOURCES = ("auto", "model", "ncu")
MATMUL_KERNELS = ("auto", "aten", "onednn")
POSITIVE_RUN_KEYS = ("batch", "ctx", "decode_tokens")
POSITIVE_MODEL_KEYS = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "ffn_dim")
INT64_MAX = 2**63 - 1  # Parquet columns are int64: a larger integer cannot be written to a row
NAME_CHARACTERS = "letters, digits, '_', '-' and '.'"  # names become part of file names


class ConfigError(ValueError):
    """A bad configuration value. str() is the one line shown to the user."""

    def __init__(self, key: str, message: str):
        super().__init__(f"{key}: {message}")
        self.key = key


def positive_int(key: str, value: Any, at_most: int = INT64_MAX) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= at_most:
        raise ConfigError(key, f"must be an integer from 1 to {at_most:,}, got {value!r}")


def non_negative_int(key: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= INT64_MAX:
        raise ConfigError(key, f"must be an integer from 0 to {INT64_MAX:,}, got {value!r}")


def positive_float(key: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ConfigError(key, f"must be a finite number above 0, got {value!r}")


def one_of(key: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(key, f"unknown value {value!r}, allowed: {', '.join(allowed)}")


def safe_name(key: str, value: Any) -> None:
    """A name that becomes part of a file name: no '/', no leading '.', nothing a shell must quote."""
    text = str(value)
    if not text or text.startswith(".") or not all(c.isalnum() or c in "_-." for c in text):
        raise ConfigError(key, f"{text!r} cannot name a file; use {NAME_CHARACTERS}, not starting with '.'")


def validate_model(model) -> None:
    safe_name("model.name", model.name)
    for key in POSITIVE_MODEL_KEYS:
        positive_int(f"model.{key}", model[key], at_most=2**31 - 1)
    if model.n_heads % model.n_kv_heads:
        raise ConfigError(
            "model.n_heads",
            f"{model.n_heads} is not divisible by model.n_kv_heads={model.n_kv_heads}; "
            "grouped-query attention needs n_heads = k * n_kv_heads",
        )
    head_dim = model.head_dim
    if head_dim is None:
        if model.d_model % model.n_heads:
            raise ConfigError(
                "model.d_model",
                f"{model.d_model} is not divisible by model.n_heads={model.n_heads}; set model.head_dim explicitly",
            )
        head_dim = model.d_model // model.n_heads
    positive_int("model.head_dim", head_dim, at_most=2**31 - 1)
    if head_dim % 2:
        raise ConfigError("model.head_dim", f"must be even for RoPE, got {head_dim}")
    positive_float("model.rope_theta", model.rope_theta)
    positive_float("model.norm_eps", model.norm_eps)


def validate_timing(timing) -> None:
    non_negative_int("timing.warmup_min", timing.warmup_min)
    if timing.warmup_max < max(timing.warmup_min, 1):
        raise ConfigError("timing.warmup_max", f"must be >= max(timing.warmup_min, 1), got {timing.warmup_max}")
    positive_int("timing.warmup_max", timing.warmup_max, at_most=10_000)
    positive_float("timing.settle_tolerance", timing.settle_tolerance)


def validate_workload(cfg) -> None:
    """The keys the runner and the analytic CLI share: the shape and the sizes of the workload."""
    for key in POSITIVE_RUN_KEYS:
        positive_int(key, cfg[key])
    validate_model(cfg.model)


def validate_run(cfg, cuda_available) -> None:
    """Raise ConfigError for the first bad value of a composed RunConfig (the strategy's own options
    are checked by its class, in harness.run.resolve).

    `cuda_available` is a callable, so a CPU-only config never pays for asking.
    """
    validate_workload(cfg)
    non_negative_int("seed", cfg.seed)
    one_of("device", cfg.device, DEVICES)
    one_of("dtype", cfg.dtype, DTYPES)
    one_of("prefill", cfg.prefill, PREFILL_MODES)
    one_of("traffic", cfg.traffic, TRAFFIC_SOURCES)
    one_of("matmul", cfg.matmul, MATMUL_KERNELS)
    validate_timing(cfg.timing)

    device = cfg.device
    if device == "cuda" and not cuda_available():
        raise ConfigError("device", "cuda was asked for but torch sees no CUDA device here; allowed: auto, cpu")
    on_cpu = device == "cpu" or (device == "auto" and not cuda_available())
    if cfg.timing.cuda_graphs and on_cpu:
        # Refused rather than ignored: a row must never claim a timing method that did not run.
        raise ConfigError("timing.cuda_graphs", "CUDA graphs need a CUDA device and this point runs on cpu; allowed: false")
    if on_cpu and cfg.traffic == "ncu":
        raise ConfigError("traffic", "ncu reads GPU DRAM counters and needs CUDA; on cpu use auto or model")

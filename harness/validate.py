"""Checks a composed config must pass before anything runs: one clear line per problem.

Types and unknown keys are already enforced by the schemas in harness.config while Hydra composes;
this module checks values: known names, positive sizes, shapes that can exist, modes that fit the
device. Every failure is a ConfigError naming the key and what is allowed.
"""
from __future__ import annotations

from typing import Any

DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "float32", "bfloat16", "float16")
PREFILL_MODES = ("compute", "random")
TRAFFIC_SOURCES = ("auto", "model", "ncu")
MATMUL_KERNELS = ("auto", "aten", "onednn")
POSITIVE_RUN_KEYS = ("batch", "ctx", "decode_tokens")
POSITIVE_MODEL_KEYS = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "ffn_dim")


class ConfigError(ValueError):
    """A bad configuration value. str() is the one line shown to the user."""

    def __init__(self, key: str, message: str):
        super().__init__(f"{key}: {message}")
        self.key = key


def _positive_int(key: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(key, f"must be a positive integer, got {value!r}")


def _one_of(key: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(key, f"unknown value {value!r}, allowed: {', '.join(allowed)}")


def validate_model(model) -> None:
    for key in POSITIVE_MODEL_KEYS:
        _positive_int(f"model.{key}", model[key])
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
    _positive_int("model.head_dim", head_dim)
    if head_dim % 2:
        raise ConfigError("model.head_dim", f"must be even for RoPE, got {head_dim}")
    if not model.rope_theta > 0:
        raise ConfigError("model.rope_theta", f"must be positive, got {model.rope_theta}")
    if not model.norm_eps > 0:
        raise ConfigError("model.norm_eps", f"must be positive, got {model.norm_eps}")


def validate_timing(timing) -> None:
    if timing.warmup_min < 0:
        raise ConfigError("timing.warmup_min", f"must be >= 0, got {timing.warmup_min}")
    if timing.warmup_max < max(timing.warmup_min, 1):
        raise ConfigError("timing.warmup_max", f"must be >= max(timing.warmup_min, 1), got {timing.warmup_max}")
    if not timing.settle_tolerance > 0:
        raise ConfigError("timing.settle_tolerance", f"must be positive, got {timing.settle_tolerance}")


def validate(cfg, cuda_available) -> None:
    """Raise ConfigError for the first bad value of a composed RunConfig.

    `cuda_available` is a callable, so a CPU-only config never pays for asking.
    """
    for key in POSITIVE_RUN_KEYS:
        _positive_int(key, cfg[key])
    if cfg.seed < 0:
        raise ConfigError("seed", f"must be >= 0, got {cfg.seed}")
    _one_of("device", cfg.device, DEVICES)
    _one_of("dtype", cfg.dtype, DTYPES)
    _one_of("prefill", cfg.prefill, PREFILL_MODES)
    _one_of("traffic", cfg.traffic, TRAFFIC_SOURCES)
    _one_of("matmul", cfg.matmul, MATMUL_KERNELS)
    validate_model(cfg.model)
    validate_timing(cfg.timing)

    from hydra.utils import get_class

    _one_of("strategy.backend", cfg.strategy.backend, ("auto", *get_class(cfg.strategy._target_).backends))
    if cfg.prefill == "random" and cfg.strategy.name == "no_cache":
        raise ConfigError("prefill", "random needs a cache to fill; no_cache recomputes the prompt, use prefill=compute")

    device = cfg.device
    if device == "cuda" and not cuda_available():
        raise ConfigError("device", "cuda was asked for but torch sees no CUDA device here; allowed: auto, cpu")
    on_cpu = device == "cpu" or (device == "auto" and not cuda_available())
    if cfg.timing.cuda_graphs and on_cpu:
        # Refused rather than ignored: a row must never claim a timing method that did not run.
        raise ConfigError("timing.cuda_graphs", "CUDA graphs need a CUDA device and this point runs on cpu; allowed: false")
    if cfg.matmul == "onednn":
        from harness.cpu_linear import onednn_supports

        dtype = "float32" if cfg.dtype == "auto" else cfg.dtype
        if not on_cpu or not onednn_supports(dtype):
            raise ConfigError("matmul", f"onednn packing is not supported for {dtype} on this device; allowed: auto, aten")
    if on_cpu and cfg.traffic == "ncu":
        raise ConfigError("traffic", "ncu reads GPU DRAM counters and needs CUDA; on cpu use auto or model")
    if cfg.traffic == "ncu":
        from harness.ncu import NCU_ENV, ncu_executable

        if ncu_executable() is None:
            raise ConfigError("traffic", f"ncu was asked for but is not on PATH (nor named by ${NCU_ENV}); allowed: auto, model")

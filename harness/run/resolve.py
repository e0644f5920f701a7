"""A composed config resolved into a Point, once per point: every `auto` decided on this machine.

The strategy is built from its `_target_` and options here, so a bad option fails before anything
runs, with one line naming it; what the class declares (name, caches_kv, exact, its cache layout)
goes into the point, and `backend=auto` is replaced by the kernel family it picks here (the contiguous
strategy's choice depends on a C compiler being there), so the key of a point never matches a row that
another kernel measured.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from omegaconf import OmegaConf

from harness.config import AccuracyConfig, ConfigError, Point, StrategyChoice, TimingConfig, model_config_from
from harness.config.point import ServingSpec
from harness.config.schema import ServingConfig, SLOConfig, WorkloadConfig
from harness.measure.prompts import content_hash
from harness.config.texts import is_builtin_text
from harness.measure.ncu import NCU_ENV, ncu_executable
from harness.model import cpu_gemv
from harness.model.cpu_linear import LinearUnavailable, choose_linear
from harness.run.catalog import strategy_class
from harness.run.inputs import accuracy_fits, accuracy_reference, checkpoint_shape, prompt_source
from harness.run.variants import chosen_of
from strategies.base import StrategyUnavailable

DEFAULT_DTYPE = {"cuda": "bfloat16", "cpu": "float32"}


def cuda_available() -> bool:
    return torch.cuda.is_available()


def resolve_device(device: str) -> str:
    return ("cuda" if cuda_available() else "cpu") if device == "auto" else device


def resolve_traffic(traffic: str, device: str) -> str:
    """`auto` uses Nsight Compute where it can read DRAM counters (CUDA with ncu on PATH)."""
    if traffic == "ncu" and ncu_executable() is None:
        raise ConfigError("traffic", f"ncu was asked for but is not on PATH (nor named by ${NCU_ENV}); allowed: auto, model")
    if traffic != "auto":
        return traffic
    return "ncu" if device == "cuda" and ncu_executable() else "model"


def checked_matmul(matmul: str, device: str, dtype: str, batch: int, bias: bool = False) -> str:
    """The point's linear kernel by harness.model.cpu_linear.choose_linear; a named one that cannot run
    here is refused in one line."""
    try:
        return choose_linear(matmul, device, dtype, batch, bias).name
    except LinearUnavailable as error:
        raise ConfigError("matmul", f"{error}; allowed: auto, aten") from None


def resolve_strategy(strategy_cfg: dict, device: str, dtype: str, shape, prefill: str, max_len: int,
                     cuda_graphs: bool = False, variant: str = "") -> StrategyChoice:
    """The strategy of a point: its class built from the options (which it checks), its capabilities,
    and `auto` resolved. A strategy that cannot run here keeps `auto`: its point becomes a skipped row
    with the reason when it runs. `variant`: its name in rows (harness.run.variants; refusals name the option chosen)."""
    if "_target_" not in strategy_cfg:
        raise ConfigError("strategy", "no _target_: pick an option of conf/strategy/ (strategy=<name>)")
    cls = strategy_class(strategy_cfg["_target_"])
    strategy = cls.from_options({k: v for k, v in strategy_cfg.items() if k != "_target_"}, chosen_of(variant) or None)
    strategy.check_point(prefill, shape, max_len)
    if cuda_graphs and not cls.graph_capturable:
        raise ConfigError("timing.cuda_graphs", f"{cls.name} cannot be captured in a CUDA graph (its steps allocate "
                                                "new tensors a replay would not see); allowed: false")
    try:
        backend = strategy.resolve_backend(torch.device(device), getattr(torch, dtype), shape)
    except StrategyUnavailable:
        backend = strategy.backend
    return StrategyChoice(name=cls.name, strategy_class=f"{cls.__module__}.{cls.__qualname__}", backend=backend,
                          caches_kv=cls.caches_kv, exact=cls.exact, strategy_options=strategy.options(),
                          layout=strategy.cache_layout(shape))


def serving_spec(cfg) -> ServingSpec | None:
    """A serving point's workload and scheduling as configured, with its trace's content hash; None for a
    step measurement (no workload chosen)."""
    if cfg.get("workload") is None:
        return None
    workload = WorkloadConfig(**OmegaConf.to_container(cfg.workload, resolve=True))
    if workload.trace is not None:
        workload = dataclasses.replace(workload, trace=str(Path(workload.trace).expanduser().resolve()))
    scheduling = OmegaConf.to_container(cfg.serving, resolve=True)
    serving = ServingConfig(**{**scheduling, "slo": SLOConfig(**scheduling["slo"])})
    trace_hash = content_hash(workload.trace, None) if workload.trace is not None else None
    return ServingSpec(workload, serving, trace_hash)


def point_from_config(cfg, variant: str = "") -> Point:
    """Resolve a composed (and validated) config into a Point; `variant`: the strategy's name in rows
    (harness.run.variants; empty: the class's name). Raises ConfigError for what only the strategy,
    the matmul kernel, the traffic source or the prompt can refuse."""
    device = resolve_device(cfg.device)
    dtype = DEFAULT_DTYPE[device] if cfg.dtype == "auto" else cfg.dtype
    model = model_config_from(OmegaConf.to_container(cfg.model, resolve=True))
    model = dataclasses.replace(model, head_dim=model.resolved_head_dim)  # resolved: no None left in a point
    strategy_cfg = OmegaConf.to_container(cfg.strategy, resolve=True)
    max_len = cfg.ctx + cfg.decode_tokens
    checkpoint_hash = checkpoint_format = None
    if model.checkpoint is not None:  # its shape replaces the preset's (harness.run.inputs)
        model, checkpoint_hash, checkpoint_format = checkpoint_shape(model, dtype, device, max_len)
    strategy = resolve_strategy(strategy_cfg, device, dtype, model, cfg.prefill, max_len, cfg.timing.cuda_graphs, variant)
    strategy = dataclasses.replace(strategy, variant=variant)
    prompt = cfg.get("prompt")
    if prompt is not None and not is_builtin_text(prompt):
        prompt = str(Path(prompt).expanduser().resolve())
    # Exact strategies run no accuracy pass: they carry the default, so accuracy.* never splits their keys.
    accuracy = AccuracyConfig() if strategy.exact else AccuracyConfig(**OmegaConf.to_container(cfg.accuracy))
    if accuracy.at_batch == cfg.batch:  # scored here: keyed as a point without at_batch, its row any sweep's
        accuracy = dataclasses.replace(accuracy, at_batch=None)
    if accuracy.max_ctx is not None and cfg.ctx <= accuracy.max_ctx:  # scored here: keyed as without max_ctx
        accuracy = dataclasses.replace(accuracy, max_ctx=None)
    scored = accuracy if not strategy.exact and accuracy.at_batch is None and accuracy.max_ctx is None else None
    if scored is not None and cfg.get("workload") is None:  # a serving run scores no accuracy pass (harness.serve.exactness)
        accuracy_fits(model, dtype, device, cfg.ctx, scored)
    return Point(
        serving=serving_spec(cfg),
        model=model,
        strategy=strategy,
        timing=TimingConfig(**OmegaConf.to_container(cfg.timing, resolve=True)),
        batch=cfg.batch,
        ctx=cfg.ctx,
        decode_tokens=cfg.decode_tokens,
        device=device,
        dtype=dtype,
        seed=cfg.seed,
        prefill=cfg.prefill,
        traffic=resolve_traffic(cfg.traffic, device),
        matmul=checked_matmul(cfg.matmul, device, dtype, cfg.batch, model.attention_bias),
        threads=torch.get_num_threads(),
        compile=cfg.compile,
        memory_limit_bytes=int(cfg.memory_limit_bytes) if cfg.memory_limit_bytes is not None else None,
        hugepages=cfg.hugepages,
        weights="checkpoint" if checkpoint_hash is not None else "random",
        checkpoint_hash=checkpoint_hash,
        checkpoint_format=checkpoint_format,
        prompt=prompt,
        prompt_hash=prompt_source(prompt, model, cfg.prefill, cfg.batch, cfg.ctx, cfg.decode_tokens, scored)
        if prompt else None,
        reference=accuracy_reference(strategy, model, device, dtype),
        accuracy=accuracy,
    )

"""A point: one fully resolved measurement (no `auto` left), and the key that identifies it.

The key hashes everything that changes what is measured (shape, strategy, sizes, device, dtype,
seed, modes, timing method) and nothing that does not (where results go, whether to overwrite), so a
re-run of a sweep recognises the points it already has.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from typing import Any

from harness.config import ModelConfig, TimingConfig, model_config_from

DEFAULT_DTYPE = {"cuda": "bfloat16", "cpu": "float32"}


@dataclass(frozen=True)
class Point:
    model: ModelConfig  # decoder shape
    strategy: dict  # strategy config as composed: _target_, name, backend
    timing: TimingConfig  # timing method
    batch: int  # sequences decoded together
    ctx: int  # prompt tokens per sequence
    decode_tokens: int  # timed decode steps
    device: str  # cpu | cuda (resolved from auto)
    dtype: str  # float32 | bfloat16 | float16 (resolved from auto)
    seed: int  # seeds weights and prompt
    prefill: str  # compute | random
    traffic: str  # model | ncu (resolved from auto)
    matmul: str = "aten"  # aten | onednn (resolved from auto): the linear layers' kernel

    @property
    def strategy_name(self) -> str:
        return self.strategy["name"]

    def identity(self) -> dict[str, Any]:
        """Everything that defines the measurement, as plain JSON-able values."""
        return asdict(self)

    @property
    def key(self) -> str:
        canonical = json.dumps(self.identity(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()[:16]

    def label(self) -> str:
        return f"{self.strategy_name} {self.model.name} b={self.batch} ctx={self.ctx} {self.device}/{self.dtype}"


def point_from_identity(identity: dict) -> Point:
    """Inverse of Point.identity(): the nested dataclasses come back from their dicts."""
    return Point(**{**identity, "model": ModelConfig(**identity["model"]), "timing": TimingConfig(**identity["timing"])})


def cuda_available() -> bool:
    import torch  # imported here: resolving `auto` is the only reason the parent process needs torch

    return torch.cuda.is_available()


def resolve_device(device: str) -> str:
    return ("cuda" if cuda_available() else "cpu") if device == "auto" else device


def resolve_traffic(traffic: str, device: str) -> str:
    """`auto` uses Nsight Compute where it can read DRAM counters (CUDA with ncu on PATH)."""
    if traffic != "auto":
        return traffic
    from harness.ncu import ncu_executable

    return "ncu" if device == "cuda" and ncu_executable() else "model"


def resolve_backend(strategy: dict, device: str, dtype: str, shape: ModelConfig) -> dict:
    """The strategy config with `backend=auto` replaced by the kernel it picks on this machine (the
    contiguous strategy's choice depends on a C compiler being there), so the key of a point never
    matches a row that another kernel measured. A strategy that cannot run here keeps `auto`: its
    point is recorded as skipped, with the reason, when it runs."""
    if strategy.get("backend") != "auto":
        return strategy
    import torch
    from hydra.utils import get_class

    from strategies.base import StrategyUnavailable

    chosen = get_class(strategy["_target_"])(name=strategy["name"], backend="auto")
    try:
        backend = chosen.resolve_backend(torch.device(device), getattr(torch, dtype), shape)
    except StrategyUnavailable:
        return strategy
    return {**strategy, "backend": backend}


def point_from_config(cfg) -> Point:
    """Resolve a composed (and validated) config into a Point."""
    from omegaconf import OmegaConf

    from harness.cpu_linear import resolve_matmul

    device = resolve_device(cfg.device)
    dtype = DEFAULT_DTYPE[device] if cfg.dtype == "auto" else cfg.dtype
    model = model_config_from(OmegaConf.to_container(cfg.model, resolve=True))
    strategy = resolve_backend(OmegaConf.to_container(cfg.strategy, resolve=True), device, dtype, model)
    return Point(
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
        matmul=resolve_matmul(cfg.matmul, device, dtype),
        traffic=resolve_traffic(cfg.traffic, device),
    )

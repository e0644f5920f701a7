"""Typed configuration: the schemas Hydra validates every composed config against.

Each dataclass is registered in Hydra's ConfigStore (see `register_schemas`), and `conf/config.yaml`
lists the schema first in its defaults, so a wrong type or an unknown key fails while composing,
before anything runs. Checks a type cannot express (positive sizes, divisibility, known names) live in
`harness.validate`.

This module imports neither torch nor Hydra at import time: the analytic model and the report use
these dataclasses on machines without torch.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional


@dataclass
class ModelConfig:
    """Shape of a Llama-3-style decoder. Weights are random (seeded); only the shape matters.

    The defaults are the CPU default preset (conf/model/cpu_small.yaml)."""

    name: str = "cpu_small"  # preset name, recorded in every row as `model`
    vocab_size: int = 32000  # rows of the embedding and columns of the untied output head
    d_model: int = 512  # residual stream width
    n_layers: int = 8  # decoder blocks
    n_heads: int = 8  # query heads per layer
    n_kv_heads: int = 2  # key/value heads per layer; n_heads / n_kv_heads queries share one KV head (GQA)
    ffn_dim: int = 1536  # hidden width of the SwiGLU MLP
    head_dim: Optional[int] = None  # per-head width; None means d_model // n_heads
    rope_theta: float = 500000.0  # RoPE base frequency (Llama 3)
    norm_eps: float = 1e-5  # RMSNorm epsilon

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim if self.head_dim is not None else self.d_model // self.n_heads

    @property
    def group_size(self) -> int:
        """Query heads that read the same KV head."""
        return self.n_heads // self.n_kv_heads


@dataclass
class StrategyConfig:
    """Which decode strategy runs a point. `_target_` names the class in `strategies/`."""

    _target_: str = "strategies.contiguous.ContiguousStrategy"  # class instantiated by Hydra
    name: str = "contiguous"  # recorded in every row as `strategy`
    backend: str = "auto"  # kernel family where a strategy has several (flash: auto|flash_attn|torch)


@dataclass
class TimingConfig:
    """How decode steps are timed (see README, 'Timing method')."""

    warmup_min: int = 2  # warm-up steps always run before timing
    warmup_max: int = 20  # warm-up stops here even if step times have not settled
    settle_tolerance: float = 0.05  # warm-up ends when two consecutive steps differ by less than this fraction
    cuda_graphs: bool = False  # CUDA only: capture each decode step at its position, time its replay (harness.graphs)
    cold_cache: bool = False  # evict the last-level cache (CPU) or L2 (GPU) before each timed step


@dataclass
class RunConfig:
    """One measured point, or with Hydra's multirun, one point of a sweep."""

    model: ModelConfig = field(default_factory=ModelConfig)  # decoder shape (conf/model/)
    strategy: StrategyConfig = field(default_factory=StrategyConfig)  # decode strategy (conf/strategy/)
    timing: TimingConfig = field(default_factory=TimingConfig)  # timing method
    batch: int = 1  # sequences decoded together
    ctx: int = 128  # prompt tokens per sequence (the context before the first decode step)
    decode_tokens: int = 16  # greedy decode steps, each timed on its own
    device: str = "auto"  # auto|cpu|cuda; auto is cuda when available
    dtype: str = "auto"  # auto|float32|bfloat16|float16; auto is bfloat16 on CUDA, float32 on CPU
    seed: int = 0  # seeds weights and prompt tokens
    prefill: str = "compute"  # compute: run the prompt; random: fill the cache with random K/V (cached strategies)
    matmul: str = "auto"  # auto|aten|onednn: CPU linear kernel; auto is oneDNN-packed where supported
    traffic: str = "auto"  # auto|model|ncu: where bytes_per_step_measured comes from
    calibrate: bool = False  # re-measure the device's roofs even if a calibration record exists
    results_dir: str = "results"  # Parquet rows, Hydra logs (_hydra/) and the calibration (_calibration/)
    overwrite: bool = False  # re-run points that already have a row for the same resolved config
    isolate: bool = True  # run each point in its own process, so its memory peak is its own


def register_schemas() -> None:
    """Register the schemas with Hydra's ConfigStore (imported lazily: Hydra is only needed to run)."""
    from hydra.core.config_store import ConfigStore

    store = ConfigStore.instance()
    store.store(name="run_schema", node=RunConfig)
    store.store(group="model", name="model_schema", node=ModelConfig)
    store.store(group="strategy", name="strategy_schema", node=StrategyConfig)


def model_config_from(mapping: Any) -> ModelConfig:
    """A ModelConfig from a dict or DictConfig (ignores Hydra's `_target_`-style extras)."""
    known = ModelConfig.__dataclass_fields__.keys()
    return ModelConfig(**{k: mapping[k] for k in known if k in mapping})

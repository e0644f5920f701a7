"""A point: one fully resolved measurement (no `auto` left), and the key that identifies it.

harness.run.resolve turns a composed config into a Point once; everything downstream (the point's
process, the row, the file name, ncu's re-run) works from the Point alone. The key hashes everything
that changes what is measured (shape, strategy and its options, sizes, device, dtype, seed, modes,
timing method, thread count) and nothing that does not (where results go, whether to overwrite), so a
re-run of a sweep recognises the points it already has.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field, fields
from typing import Any, ClassVar, Optional

from harness.config.layout import CacheLayout
from harness.config.schema import ModelConfig, TimingConfig


@dataclass(frozen=True)
class StrategyChoice:
    """The strategy of a point as resolved: its class, its options, and what the class declares."""

    ROW_PREFIX: ClassVar[str] = ""  # columns strategy (its name), strategy_class, backend, caches_kv, exact, ...

    name: str  # the class's name attribute (strategies.base.Strategy.name): the row's `strategy`
    strategy_class: str  # import path of the class, e.g. strategies.contiguous.ContiguousStrategy
    backend: str  # the kernel family that runs (auto resolved on this machine)
    caches_kv: bool  # the class stores K/V between steps
    exact: bool  # the class is proven to generate the no-cache reference's tokens
    strategy_options: dict = field(default_factory=dict)  # the class's other options as configured (block_size, ...)
    layout: Optional[CacheLayout] = None  # how it stores K/V (None: it stores none)

    def instantiate(self):
        """The strategy object (imports strategies/ only when called)."""
        from harness.config.validate import target_class

        return target_class("strategy_class", self.strategy_class)(backend=self.backend, **self.strategy_options)


# Point and ModelConfig fields a key leaves out while at their defaults: they came after keys did, and
# a point of random weights and prompts keeps the key it had before.
POINT_FIELDS_KEYED_WHEN_SET = ("weights", "checkpoint_hash", "prompt", "prompt_hash", "reference", "repeat")
MODEL_FIELDS_KEYED_WHEN_SET = ("checkpoint", "attention_bias", "tie_embeddings", "rope_scaling", "rope_scaling_factor",
                               "rope_low_freq_factor", "rope_high_freq_factor", "rope_original_max_len")


def _drop_defaults(identity: dict, cls: type, names: tuple[str, ...]) -> None:
    defaults = {f.name: f.default for f in fields(cls)}
    for name in names:
        if identity[name] == defaults[name]:
            del identity[name]


@dataclass(frozen=True)
class Point:
    model: ModelConfig  # decoder shape
    strategy: StrategyChoice  # what stores and reads the cache
    timing: TimingConfig  # timing method
    batch: int  # sequences decoded together
    ctx: int  # prompt tokens per sequence
    decode_tokens: int  # timed decode steps
    device: str  # cpu | cuda (resolved from auto)
    dtype: str  # float32 | bfloat16 | float16 (resolved from auto)
    seed: int  # seeds weights and prompt
    prefill: str  # compute | random
    traffic: str  # model | ncu (resolved from auto)
    matmul: str  # aten | onednn | c (resolved from auto): the linear layers' kernel
    threads: int  # torch intra-op threads the point runs with
    compile: str = "none"  # none | inductor: decode steps eager or through torch.compile
    # Bytes the point may use, when smaller than the device's free memory (None: the device's). It
    # decides whether the point runs, not what it measures: left out of the key while unset.
    memory_limit_bytes: Optional[int] = None
    # CPU tensors of 2 MiB or more on 2 MiB pages (THP_MEM_ALLOC_ENABLE): fewer TLB misses and page
    # faults for tables and pools. Left out of the key while false, so earlier points keep theirs.
    hugepages: bool = False
    # What the weights and the prompt are: `random` (seeded) or `checkpoint` (model.checkpoint), with
    # the checkpoint's content hash (harness.model.checkpoint); the prompt file and its
    # content hash (None: seeded random ids). Left out of the key while random, so earlier points keep theirs.
    weights: str = "random"
    checkpoint_hash: Optional[str] = None
    # How the checkpoint's tensors were stored and what they became in `dtype` ("gguf: Q4_1 x210, ...,
    # dequantized to float32"; harness.run.inputs). Not in the key: the hash and the dtype decide it.
    checkpoint_format: Optional[str] = None
    prompt: Optional[str] = None
    prompt_hash: Optional[str] = None
    # Approximate strategies: the exact strategy their accuracy is measured against, "<class path>:<backend>"
    # (chosen by capability in harness.run.inputs); None for exact ones.
    reference: Optional[str] = None
    # shape: timed in one process with the sweep's other points of the same shape, steps interleaved
    # (harness.measure.group); none: timed alone. Not in the key: it says how the point was timed, not
    # what (its row's group_id and group_size say with whom); overwrite=true measures it again.
    interleave: str = "none"
    repeat: int = 0  # which of the sweep's `repeats` measurements of this point; left out of the key while 0

    @property
    def max_len(self) -> int:
        """Tokens per sequence at the end of the point: what a preallocated cache holds."""
        return self.ctx + self.decode_tokens

    def identity(self) -> dict[str, Any]:
        """Everything that defines the measurement, as plain JSON-able values."""
        identity = asdict(self)
        if identity["memory_limit_bytes"] is None:
            del identity["memory_limit_bytes"]  # keys of points without a limit stay as they were
        if not identity["hugepages"]:
            del identity["hugepages"]  # likewise for points on the default pages
        del identity["interleave"]  # how it was timed, not what: a re-run alone or in another group finds its row
        del identity["checkpoint_format"]  # follows from checkpoint_hash and dtype
        _drop_defaults(identity, Point, POINT_FIELDS_KEYED_WHEN_SET)  # and for points of random weights and prompts
        _drop_defaults(identity["model"], ModelConfig, MODEL_FIELDS_KEYED_WHEN_SET)
        return identity

    @property
    def key(self) -> str:
        canonical = json.dumps(self.identity(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()[:16]

    def group_key(self) -> str:
        """What a point shares with the points it is timed with (harness.run.grouping): everything but the
        strategy, the linear kernel, the compile mode and the accuracy reference that follows the strategy;
        and whether it caches K/V. A recompute strategy's step is compute-bound where a cached one's is
        memory-bound: their ratio moves with the machine's balance of the two between runs, which rounds
        cannot cancel, and its long steps would cap the rounds of every cached member beside it."""
        shared = {k: v for k, v in self.identity().items() if k not in ("strategy", "matmul", "compile", "reference")}
        shared["caches_kv"] = self.strategy.caches_kv
        canonical = json.dumps(shared, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()[:16]

    def label(self) -> str:
        """How progress lines and errors name the point: the run options that tell two points of one
        sweep apart are in it (a compiled step, 2 MiB pages)."""
        options = ((f" compile={self.compile}" if self.compile != "none" else "") + (" hugepages" if self.hugepages else "")
                   + (f" repeat={self.repeat}" if self.repeat else ""))
        return f"{self.strategy.name} {self.model.name} b={self.batch} ctx={self.ctx} {self.device}/{self.dtype}{options}"


def point_from_identity(identity: dict) -> Point:
    """Inverse of Point.identity(): the nested dataclasses come back from their dicts."""
    strategy = dict(identity["strategy"])
    layout = strategy.get("layout")
    strategy["layout"] = CacheLayout(**layout) if layout is not None else None
    return Point(**{**identity, "model": ModelConfig(**identity["model"]), "strategy": StrategyChoice(**strategy),
                    "timing": TimingConfig(**identity["timing"])})

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
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar, Optional

from harness.config.keys import NOT_IN_KEY, OPTIONAL_IN_KEY, keyed_as, keyed_fields
from harness.config.layout import CacheLayout, could_be_reference
from harness.config.schema import AccuracyConfig, ModelConfig, ServingConfig, SLOConfig, TimingConfig, WorkloadConfig
from harness.config.validate import target_class


# Field metadata read by harness.run.row.flatten: the column a field becomes under another name than
# its own, or no column at all (a setting whose effect the row's measured columns state).
COLUMN = "column"
NO_COLUMNS = {COLUMN: None}
NULL_COLUMNS_OF = "null_columns_of"  # a dataclass field that may be None: its columns (of a default instance) stay null
# Fields of a point's identity that follow its strategy: the points timed together in one group differ
# only in these (Point.group_key; harness.run.windows compares groups that differ in them and in ctx).
FOLLOW_THE_STRATEGY = ("strategy", "matmul", "compile", "reference", "accuracy")
# The sub-packages that sort strategies by kind (caches inside the decoder, foreign engines). A class's
# place among them is not what it measures, and the classes lived directly under strategies/ before
# they were sorted: keys hash the path without the kind, so rows measured before keep their keys.
KIND_PACKAGES = ("strategies.caches.", "strategies.engines.")


def class_identity(path: str | None) -> str | None:
    """A strategy class path (or "<class path>:<backend>") as the key hashes it: without the kind's
    sub-package (strategies.caches.contiguous.ContiguousStrategy is keyed without its `caches.`)."""
    if path is None:
        return None
    for kind in KIND_PACKAGES:
        if path.startswith(kind):
            return "strategies." + path[len(kind):]
    return path


@dataclass(frozen=True)
class StrategyChoice:
    """The strategy of a point as resolved: its class, its options, and what the class declares."""

    ROW_PREFIX: ClassVar[str] = ""  # columns strategy (the variant), strategy_class, backend, caches_kv, ...

    # the class's name attribute (strategies.base.Strategy.name): the row's `strategy_family`
    name: str = field(metadata={COLUMN: "strategy_family"})
    # import path of the class, e.g. strategies.caches.contiguous.ContiguousStrategy (keyed without the kind)
    strategy_class: str = field(metadata=keyed_as(class_identity))
    backend: str  # the kernel family that runs (auto resolved on this machine)
    caches_kv: bool  # the class stores K/V between steps
    exact: bool  # the class is proven to generate the no-cache reference's tokens
    strategy_options: dict = field(default_factory=dict)  # the class's other options as configured (block_size, ...)
    layout: Optional[CacheLayout] = None  # how it stores K/V (None: it stores none)
    # The name rows, progress lines and reports give it: the option chosen under conf/strategy/ (int8,
    # kivi4, paged32), with the options set beside it appended (harness.run.variants); empty: the
    # class's name. Not in the key: a variant and the same class and options set by hand measure the same.
    variant: str = field(default="", metadata={**NOT_IN_KEY, COLUMN: "strategy"})

    def __post_init__(self):
        if not self.variant:
            object.__setattr__(self, "variant", self.name)

    @property
    def could_be_reference(self) -> bool:
        """Whether the others are set against this strategy (harness.config.layout.could_be_reference)."""
        return could_be_reference(self.exact, self.layout)

    def instantiate(self):
        """The strategy object (imports strategies/ only when called)."""
        return target_class("strategy_class", self.strategy_class)(backend=self.backend, **self.strategy_options)


@dataclass(frozen=True)
class ServingSpec:
    """A serving run's part of a point (harness.serve): its workload and how it is scheduled, as
    configured; the point's batch, ctx and decode_tokens then say nothing of what it measures."""

    ROW_PREFIX: ClassVar[str] = ""  # its dataclasses' own prefixes: workload_*, serving_*
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)  # the requests (conf/workload/)
    serving: ServingConfig = field(default_factory=ServingConfig)  # the budget, chunks, SLOs
    # A trace file's content hash (harness.serve.workload; the key's, so an edited trace is served
    # again); None for a synthetic workload
    workload_hash: Optional[str] = None


@dataclass(frozen=True)
class Point:
    """One measurement, resolved. Its key hashes every field as harness.config.keys states, once."""

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
    # decides whether the point runs, not what it measures.
    memory_limit_bytes: Optional[int] = field(default=None, metadata=OPTIONAL_IN_KEY)
    # CPU tensors of 2 MiB or more on 2 MiB pages (THP_MEM_ALLOC_ENABLE): fewer TLB misses and page
    # faults for tables and pools.
    hugepages: bool = field(default=False, metadata=OPTIONAL_IN_KEY)
    # What the weights are: `random` (seeded) or `checkpoint` (model.checkpoint), with the checkpoint's
    # content hash (harness.model.checkpoint).
    weights: str = field(default="random", metadata=OPTIONAL_IN_KEY)
    checkpoint_hash: Optional[str] = field(default=None, metadata=OPTIONAL_IN_KEY)
    # How the checkpoint's tensors were stored and what they became in `dtype` ("gguf: Q4_1 x210, ...,
    # dequantized to float32"; harness.run.inputs). Not in the key: the hash and the dtype decide it.
    checkpoint_format: Optional[str] = field(default=None, metadata=NOT_IN_KEY)
    # The prompt: a file or a built-in text (harness.measure.prompts), and its content hash; None:
    # seeded random ids.
    prompt: Optional[str] = field(default=None, metadata=OPTIONAL_IN_KEY)
    prompt_hash: Optional[str] = field(default=None, metadata=OPTIONAL_IN_KEY)
    # Approximate strategies: the exact strategy their accuracy is measured against, "<class path>:<backend>"
    # (chosen by capability in harness.run.inputs); None for exact ones.
    reference: Optional[str] = field(default=None, metadata={**OPTIONAL_IN_KEY, **keyed_as(class_identity)})
    # How the accuracy pass of an approximate strategy runs; exact strategies carry the default (they
    # run none), so the setting never splits their keys. The row's measured accuracy columns say what ran.
    accuracy: AccuracyConfig = field(default_factory=AccuracyConfig, metadata={**OPTIONAL_IN_KEY, **NO_COLUMNS})
    # shape: timed in one process with the sweep's other points of the same shape, steps interleaved
    # (harness.measure.group); none: timed alone. How the point was timed, not what (its row's
    # group_id and group_size say with whom): a re-run alone or in another group finds its row, and
    # overwrite=true measures it again.
    interleave: str = field(default="none", metadata=NOT_IN_KEY)
    # which of the sweep's `repeats` measurements of this point
    repeat: int = field(default=0, metadata=OPTIONAL_IN_KEY)
    # A serving run instead of a step measurement (harness.serve); None: the point times decode steps.
    # Its columns are null on a step row (NULL_COLUMNS_OF).
    serving: Optional[ServingSpec] = field(default=None, metadata={**OPTIONAL_IN_KEY, NULL_COLUMNS_OF: ServingSpec})

    @property
    def max_len(self) -> int:
        """Tokens per sequence at the end of the point: what a preallocated cache holds."""
        return self.ctx + self.decode_tokens

    def identity(self, hashed: bool = False) -> dict[str, Any]:
        """Everything that defines the measurement, as plain JSON-able values (harness.config.keys);
        `hashed`: in the form the key hashes (a strategy class without its kind's sub-package)."""
        return keyed_fields(self, hashed)

    def record(self) -> dict[str, Any]:
        """Every field, as plain JSON-able values: a row's config_json, and what another process
        rebuilds the point from (point_from_record)."""
        return asdict(self)

    @property
    def key(self) -> str:
        canonical = json.dumps(self.identity(hashed=True), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()[:16]

    def group_key(self) -> str:
        """What a point shares with the points it is timed with (harness.run.grouping): everything but the
        strategy, the linear kernel, the compile mode, and the accuracy reference and pass that follow the
        strategy; and whether it caches K/V. A recompute strategy's step is compute-bound where a cached one's is
        memory-bound: their ratio moves with the machine's balance of the two between runs, which rounds
        cannot cancel, and its long steps would cap the rounds of every cached member beside it."""
        shared = {k: v for k, v in self.identity(hashed=True).items() if k not in FOLLOW_THE_STRATEGY}
        shared["caches_kv"] = self.strategy.caches_kv
        canonical = json.dumps(shared, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()[:16]

    def label(self) -> str:
        """How progress lines and errors name the point: the run options that tell two points of one
        sweep apart are in it (a compiled step, 2 MiB pages; a serving run's workload, rate and budget)."""
        options = ((f" compile={self.compile}" if self.compile != "none" else "") + (" hugepages" if self.hugepages else "")
                   + (f" repeat={self.repeat}" if self.repeat else ""))
        if self.serving is not None:
            workload, budget = self.serving.workload, self.serving.serving.kv_budget_bytes
            rate = f" rate={workload.rate:g}/s" if workload.rate is not None and workload.arrival in ("poisson", "gamma") else ""
            serving = self.serving.serving
            kv = f"kv={budget / 2**20:.0f}MiB" if budget is not None else "kv=node"
            simulated = (f" simulated={serving.executor}" + (f"@{serving.tp}x{serving.hardware}" if serving.hardware else "")
                         if serving.executor != "measured" else "")
            return (f"{self.strategy.variant} {self.model.name} serving {workload.name} {workload.arrival}{rate} "
                    f"{kv} {self.device}/{self.dtype}{options}{simulated}")
        return f"{self.strategy.variant} {self.model.name} b={self.batch} ctx={self.ctx} {self.device}/{self.dtype}{options}"


def point_from_record(record: dict) -> Point:
    """Inverse of Point.record(), and of Point.identity() but for the fields it leaves out (their
    defaults come back): the nested dataclasses come back from their dicts."""
    strategy = dict(record["strategy"])
    layout = strategy.get("layout")
    strategy["layout"] = CacheLayout(**layout) if layout is not None else None
    accuracy = AccuracyConfig(**record["accuracy"]) if "accuracy" in record else AccuracyConfig()
    serving = record.get("serving")
    if serving is not None:
        scheduling = dict(serving["serving"])
        scheduling["slo"] = SLOConfig(**scheduling["slo"])
        serving = ServingSpec(WorkloadConfig(**serving["workload"]), ServingConfig(**scheduling), serving["workload_hash"])
    return Point(**{**record, "model": ModelConfig(**record["model"]), "strategy": StrategyChoice(**strategy),
                    "timing": TimingConfig(**record["timing"]), "accuracy": accuracy, "serving": serving})

"""Typed configuration: the schemas Hydra validates every composed config against.

Each dataclass is registered in Hydra's ConfigStore (`register_schemas`), and `conf/config.yaml` lists
the run schema first in its defaults, so a wrong type or an unknown key fails while composing, before
anything runs. The defaults of every run key live here and nowhere else (`python -m harness.run --cfg
job` prints them); the YAML files under conf/ hold the presets (model shapes, strategies, sweeps).
Checks a type cannot express (positive sizes, divisibility, known names) are in harness.config.validate.

The strategy node is untyped here on purpose: each strategy class declares its own options
(strategies.base.Strategy) and checks them itself, so a strategy added under strategies/ (or under a
folder on Hydra's search path) brings its options without an edit to this file.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any, ClassVar, Optional, Union, get_args, get_origin, get_type_hints

from harness.config.keys import OPTIONAL_IN_KEY


@dataclass
class ModelConfig:
    """Shape of a Llama-3-style decoder. Weights are random (seeded; only the shape matters), or a
    checkpoint's, whose config.json (a GGUF file's metadata) then gives the shape."""

    ROW_PREFIX: ClassVar[str] = ""  # rows name these columns as they are: d_model, n_layers, ...

    name: str  # preset name (conf/model/<name>.yaml), recorded in every row as `model`
    vocab_size: int  # rows of the embedding and columns of the untied output head
    d_model: int  # residual stream width
    n_layers: int  # decoder blocks
    n_heads: int  # query heads per layer
    n_kv_heads: int  # key/value heads per layer; n_heads / n_kv_heads queries share one KV head (GQA)
    ffn_dim: int  # hidden width of the SwiGLU MLP
    head_dim: Optional[int] = None  # per-head width; None means d_model // n_heads
    rope_theta: float = 500000.0  # RoPE base frequency (Llama 3)
    norm_eps: float = 1e-5  # RMSNorm epsilon
    # The fields below are a real checkpoint's, filled from its config.json when `checkpoint` is set
    # (harness.model.checkpoint); left at their defaults they change nothing, nor a point's key
    # (OPTIONAL_IN_KEY, harness.config.keys).
    # Hugging Face format folder (config.json, *.safetensors) or GGUF file, a path or pkg:PACKAGE/FILE;
    # None: seeded random weights
    checkpoint: Optional[str] = field(default=None, metadata=OPTIONAL_IN_KEY)
    # the q, k and v projections carry a bias (Qwen2)
    attention_bias: bool = field(default=False, metadata=OPTIONAL_IN_KEY)
    # the output head is the embedding table (tie_word_embeddings)
    tie_embeddings: bool = field(default=False, metadata=OPTIONAL_IN_KEY)
    # None; linear: every position divided by rope_scaling_factor; llama3: Llama 3.1's frequency-dependent stretch
    rope_scaling: Optional[str] = field(default=None, metadata=OPTIONAL_IN_KEY)
    # linear: the positions' divisor; llama3: how far low frequencies are stretched (factor)
    rope_scaling_factor: float = field(default=1.0, metadata=OPTIONAL_IN_KEY)
    # llama3: wavelengths above original_max_len / this are stretched in full
    rope_low_freq_factor: float = field(default=1.0, metadata=OPTIONAL_IN_KEY)
    # llama3: wavelengths below original_max_len / this are kept
    rope_high_freq_factor: float = field(default=4.0, metadata=OPTIONAL_IN_KEY)
    # llama3: the context the model was first trained at (original_max_position_embeddings)
    rope_original_max_len: int = field(default=8192, metadata=OPTIONAL_IN_KEY)

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim if self.head_dim is not None else self.d_model // self.n_heads

    @property
    def group_size(self) -> int:
        """Query heads that read the same KV head."""
        return self.n_heads // self.n_kv_heads


@dataclass
class TimingConfig:
    """How decode steps are timed (docs/method.md, 'Timing')."""

    ROW_PREFIX: ClassVar[str] = "timing_"  # columns timing_warmup_min, timing_cuda_graphs, ...

    warmup_min: int = 2  # warm-up steps always run before timing
    warmup_max: int = 20  # warm-up stops here even if step times have not settled
    settle_tolerance: float = 0.05  # warm-up ends when two consecutive steps differ by less than this fraction
    cuda_graphs: bool = False  # CUDA only: capture each decode step at its position, time its replay
    cold_cache: bool = False  # evict the last-level cache (CPU) or L2 (GPU) before each timed step
    prefill_repeats: int = 5  # times the prompt is timed at most, each on a fresh session (median recorded)
    prefill_budget_s: float = 1.0  # no further repeat once the prompt's timings would pass this many seconds
    # A group replays its decode positions (rewound, the same tokens) while one more pass of its rounds
    # fits this budget, up to max_passes: cheap steps get more rounds and narrower intervals
    rounds_budget_s: float = 5.0
    max_passes: int = 8  # passes over the decode positions at most (1: each position timed once)
    # CPU: while other processes hold cores, run the eager steps on torch's threads (our caches; not an
    # engine's pool, nor a compiled step) at fewer threads, refitted every 0.1 s, so no barrier waits on a
    # thread queued behind another process (harness.measure.threads; decode_steps_fewer_threads counts
    # such steps). false: `threads` throughout
    adapt_threads: bool = field(default=True, metadata=OPTIONAL_IN_KEY)


@dataclass
class AccuracyConfig:
    """How an approximate strategy's accuracy pass runs (docs/method.md, 'Accuracy'): after the timed
    steps, windows of the prompt text are each prefilled at the point's ctx and then teacher-forced one
    token a decode step through the exact reference and through the strategy's cache, and every step's
    logits are scored. Exact strategies run no pass."""

    tokens: int = 1024  # tokens scored per point, whatever decode_tokens is: windows x steps
    # decode steps per window, each scoring one token; windows' scored tokens never overlap (their prompts may);
    # at most `tokens` (harness.config.validate): a step past the tokens scored would score nothing
    steps: int = 64
    batch: int = 16  # windows run together as one batch (a chunk); bounds the pass's memory
    # Score only the points of this batch: the pass does not depend on a point's batch (its windows run
    # `batch` at a time in sessions of their own), so a sweep over batches need not pay it once per batch;
    # the other batches' rows leave the scores null and say which batch holds them. None: every point
    at_batch: Optional[int] = field(default=None, metadata=OPTIONAL_IN_KEY)
    # Score only the points of at most this ctx: each window's prompt is prefilled once per scored variant,
    # so a long context's pass costs a long prefill per window and member; the longer contexts' rows leave
    # the scores null and say up to which ctx they were scored. None: every context
    max_ctx: Optional[int] = field(default=None, metadata=OPTIONAL_IN_KEY)
    # The recall probe (windows whose prompts end by repeating an early span): what an evicting cache
    # drops; false leaves the recall_* columns null and halves the pass, for caches that keep every token
    recall: bool = field(default=True, metadata=OPTIONAL_IN_KEY)


@dataclass
class WorkloadConfig:
    """A serving run's requests (harness.serve.workload; conf/workload/): each request's prompt and
    output lengths, what it asks the server to reserve for, and when it arrives."""

    ROW_PREFIX: ClassVar[str] = "workload_"  # columns workload (the name), workload_lengths, workload_rate, ...

    name: str = "sharegpt"  # the workload's name in rows: the conf/workload/ option chosen
    # Where each request's lengths come from: sharegpt or alpaca (seeded draws whose means the vLLM paper
    # publishes), fixed (prompt_len and output_len for every request), or trace (the file `trace`)
    lengths: str = "sharegpt"
    # lengths=trace or arrival=trace: a CSV with the Azure LLM inference trace's columns TIMESTAMP,
    # ContextTokens, GeneratedTokens, or JSONL with prompt_len, output_len and arrival_s per line
    trace: Optional[str] = None
    requests: int = 64  # requests in the workload (from a trace: its first this many)
    prompt_len: int = 128  # lengths=fixed: every request's prompt tokens
    output_len: int = 128  # lengths=fixed: every request's output tokens
    length_scale: float = 1.0  # every prompt and output length multiplied by this (rounded, at least 1)
    # The output a request asks for at most, as a client's max_tokens: drawn or read outputs are cut to
    # it, and a reservation-based server reserves prompt + max_tokens; None: each request's own length
    max_tokens: Optional[int] = None
    arrival: str = "poisson"  # all_at_once | poisson | gamma | closed | trace (the trace's timestamps)
    rate: Optional[float] = None  # poisson, gamma: requests per second
    burstiness: float = 1.0  # gamma: the shape of the inter-arrival times (vLLM's --burstiness; 1 is Poisson)
    concurrency: Optional[int] = None  # closed: requests in flight, the next sent when one finishes


@dataclass
class SLOConfig:
    """The latency objectives goodput counts against (a request meets them when every one set holds)."""

    ROW_PREFIX: ClassVar[str] = "serving_slo_"  # columns serving_slo_ttft_s, serving_slo_tpot_s

    ttft_s: Optional[float] = None  # time to first token at most, seconds; None: not an objective
    tpot_s: Optional[float] = None  # time per output token after the first at most, seconds; None: not an objective


@dataclass
class ServingConfig:
    """How a serving run schedules its workload (harness.serve.scheduler)."""

    ROW_PREFIX: ClassVar[str] = "serving_"  # columns serving_kv_budget_bytes, serving_prefill_chunk, ...

    # the KV cache's bytes, by the strategy's own accounting (strategies.serving); null (executor=roofline
    # only): what `tp` devices of `hardware` have left after the weights and the reserve
    kv_budget_bytes: Optional[float] = 256 * 2**20
    prefill_chunk: Optional[int] = None  # prompt tokens prefilled per iteration at most (chunked prefill); None: whole prompts
    max_batch: int = 256  # sequences running at once at most (vLLM's max_num_seqs)
    slo: SLOConfig = field(default_factory=SLOConfig)  # goodput's objectives
    # Every output token checked against the recompute reference (one teacher-forced pass per request
    # after the run, untimed): exact strategies' divergences and approximate ones' agreement
    check_tokens: bool = True
    # measured: our decoder computes every iteration on this machine; fitted or roofline: nothing runs, a
    # step-time model says how long each iteration would take (harness.serve.simulation) and the row is
    # marked simulated: fitted from this machine's rows per strategy, or the analytic model at `hardware`'s roofs
    executor: str = field(default="measured", metadata=OPTIONAL_IN_KEY)
    # fitted: which rows of results_dir the step time is fitted from: serving (the iterations of this
    # strategy's measured serving runs, the run this point simulates left out) or steps (its step points)
    fit_from: str = field(default="serving", metadata=OPTIONAL_IN_KEY)
    # roofline: the device, a datasheet of conf/hardware/ (h100_sxm, h200, a100_80g) or measured (this
    # machine's calibration record)
    hardware: Optional[str] = field(default=None, metadata=OPTIONAL_IN_KEY)
    tp: int = field(default=1, metadata=OPTIONAL_IN_KEY)  # roofline: devices the model is split over (tensor parallel)
    # roofline with kv_budget_bytes=null: the share of each device's memory kept back for activations and
    # workspace, 0 to below 1; null: the capacity plan's (harness.analysis.capacity.DEFAULT_RESERVE)
    reserve: Optional[float] = field(default=None, metadata=OPTIONAL_IN_KEY)


@dataclass
class RunConfig:
    """One measured point, or with Hydra's multirun, one point of a sweep."""

    model: ModelConfig  # decoder shape: a preset of conf/model/ (default chosen in conf/config.yaml)
    strategy: Any = field(default_factory=dict)  # decode strategy: `_target_` and the class's options (conf/strategy/)
    timing: TimingConfig = field(default_factory=TimingConfig)  # timing method
    accuracy: AccuracyConfig = field(default_factory=AccuracyConfig)  # approximate strategies: the accuracy pass
    batch: int = 1  # sequences decoded together
    ctx: int = 128  # prompt tokens per sequence (the context before the first decode step)
    decode_tokens: int = 16  # greedy decode steps, each timed on its own
    device: str = "auto"  # auto|cpu|cuda; auto is cuda when available
    dtype: str = "auto"  # auto|float32|bfloat16|float16; auto is bfloat16 on CUDA, float32 on CPU
    seed: int = 0  # seeds weights and prompt tokens
    prompt: Optional[str] = None  # file of prompt tokens (ids as .json/.npy, or text through the checkpoint's own tokenizer); None: seeded random ids
    prefill: str = "compute"  # compute: run the prompt; random: fill the cache with random K/V (cached strategies)
    matmul: str = "auto"  # auto|aten|onednn|c: linear kernel; auto on a CPU: c in fp32 at batch <= 16, else oneDNN-packed where supported
    compile: str = "none"  # none|inductor: decode steps through torch.compile (CUDA: reduce-overhead; CPU: C++ codegen)
    traffic: str = "auto"  # auto|model|ncu: where bytes_per_step_measured comes from
    calibrate: bool = False  # re-measure the device's roofs even if a calibration record exists
    results_dir: str = "results"  # Parquet rows, Hydra logs (_hydra/), the calibration (_calibration/); relative to the working directory
    overwrite: bool = False  # re-run points that already have a row for the same resolved config
    rerun_failed: bool = True  # re-run points whose row is status=failed; false keeps failed rows as they are
    rerun_other_code: bool = False  # re-run points whose row another code state made (its git_commit is not this checkout's)
    calibration_budget_s: float = 120.0  # wall-time budget of one calibration: repeats stop and the GEMM shrinks to fit it
    isolate: bool = True  # run each group in a process of its own, so its memory peaks are its members' alone
    # CPU tensors of 2 MiB or more on 2 MiB pages (torch's THP_MEM_ALLOC_ENABLE, set in the point's own
    # process before it allocates; needs isolate=true and transparent huge pages not `never`)
    hugepages: bool = False
    memory_limit_bytes: Optional[float] = None  # treat the device as this large (bytes): a point that would not fit is a skipped row
    # shape: a sweep's points that differ only in strategy, matmul or compile are timed together in one
    # process, their steps interleaved round by round, so their ratios compare; none: each point alone
    interleave: str = "shape"
    repeats: int = 1  # measure every group this many times, in shuffled order (rows keyed by `repeat`)
    search: str = "none"  # none | max_batch: find the largest batch that runs within memory_limit_bytes by bisection (+sweep=capacity)
    # A serving run instead of a step measurement (harness.serve): the requests (workload=<conf/workload/
    # option>) and how they are scheduled; None: the point measures decode steps
    workload: Optional[WorkloadConfig] = None
    serving: ServingConfig = field(default_factory=ServingConfig)


def unknown_key(tree, schema=RunConfig, prefix: str = "", skip: tuple[str, ...] = ("hydra",)):
    """The first key of a composed config (a mapping) that no field of `schema` names, as (dotted key,
    the names allowed there); None when every key is a field. Fields typed by a schema are looked into;
    `strategy` (Any) is its class's to check. A key added with `+` (`+batchs=4`, `+timing.warmup=2`)
    would otherwise be carried along unread, or fail later as a TypeError in the schema's constructor."""
    hints = get_type_hints(schema)
    types = {f.name: hints[f.name] for f in fields(schema)}  # fields only: a ClassVar is no key
    for key in tree.keys():
        name = f"{prefix}{key}"
        if name in skip:
            continue
        if key not in types:
            return name, sorted(types)
        if is_dataclass(types[key]) and hasattr(tree[key], "keys"):
            found = unknown_key(tree[key], types[key], f"{name}.", skip)
            if found:
                return found
    return None


def field_type(key: str, schema=RunConfig):
    """The type a dotted key (`accuracy.recall`) takes in `schema`, Optional[...] unwrapped; None where
    no schema field types it (a strategy's option: its class's to check; a key that does not exist)."""
    for part in key.split("."):
        found = {f.name: f for f in fields(schema)}.get(part) if is_dataclass(schema) else None
        if found is None:
            return None
        schema = get_type_hints(schema)[part]
        schema = next((a for a in get_args(schema) if a is not type(None)), schema) if get_origin(schema) is Union else schema
    return schema


def register_schemas() -> None:
    """Register the schemas with Hydra's ConfigStore (imported lazily: Hydra is only needed to run)."""
    from hydra.core.config_store import ConfigStore  # here: harness.config imports no Hydra (the report runs without it)

    store = ConfigStore.instance()
    store.store(name="run_schema", node=RunConfig)
    store.store(group="model", name="model_schema", node=ModelConfig)


def model_config_from(mapping: Any) -> ModelConfig:
    """A ModelConfig from a dict or DictConfig (ignores keys that are not fields)."""
    known = [f.name for f in fields(ModelConfig) if f.name in mapping]
    return ModelConfig(**{name: mapping[name] for name in known})

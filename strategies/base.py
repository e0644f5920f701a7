"""The interface between the decoder and a decode strategy.

Two objects per strategy:
- a `LayerCache` per layer: `attend(q, k, v, start_pos)` receives the new tokens' roped queries, keys
  and values and returns their attention output over every token so far. What it keeps between calls
  (nothing, a preallocated table, a kernel-managed table) is the strategy.
- a `DecodeSession` per point: prefill a prompt, then one `step` per generated token. It owns the layer
  caches and knows the sequence length; `rewind` returns to an earlier length, so warm-up steps can be
  repeated at the first decode position without changing the tokens a point generates.
"""
from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar, Protocol, Sequence

import torch

from harness.config import CONTIGUOUS, CacheLayout, ConfigError, ModelConfig
from harness.model.random_fill import uniform_like_normal_
from strategies.backends import Backend, StrategyUnavailable, choose
from strategies.serving import SequenceMemory


@dataclass(frozen=True)
class Agreement:
    """How close a full-precision engine member must come to the harness's exact cache (stated in its
    row), checked by harness.measure.agreement: beyond either, the row fails naming the difference
    (a strategy declares one through Strategy.agreement; the peers of strategies/engines/engine.py do)."""

    logit_rel: float  # first decode step: max |engine - exact logit| / max |exact logit|
    kl_mean: float  # the accuracy windows: mean KL(exact || engine), nats


class StrategyOptionError(ConfigError):
    """A strategy option (or a run key, with top_level) the strategy refuses: one line naming the key."""

    def __init__(self, option: str, message: str, top_level: bool = False):
        super().__init__(option if top_level else f"strategy.{option}", message)


class LayerCache(Protocol):
    """Per-layer cache. Caching strategies also expose `k`, `v` (their tables), `seq_dim` (the
    position axis of those tables) and `nbytes` (bytes allocated)."""

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start_pos: int) -> torch.Tensor:
        """q [B, T, H, D], k/v [B, T, n_kv, D] at positions start_pos.. -> output [B, T, H, D].

        Causal: the query at position start_pos + t sees keys 0 .. start_pos + t.
        """
        ...


class DecodeSession(ABC):
    """Prefill and step through one batch of sequences of at most `max_len` tokens."""

    length: int  # tokens of each sequence processed so far (prompt + fed generated tokens)

    @abstractmethod
    def prefill(self, prompt: torch.Tensor) -> torch.Tensor:
        """prompt [B, P] token ids -> logits [B, vocab] of the last prompt position."""

    @abstractmethod
    def step(self, token: torch.Tensor) -> torch.Tensor:
        """token [B], the token at position `length` -> logits [B, vocab] for the next position."""

    def rewind(self, length: int) -> None:
        """Forget every token at position >= length (their cache entries are overwritten later)."""
        if not 0 < length <= self.length:
            raise ValueError(f"cannot rewind to {length} from {self.length}")
        self.length = length

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes of cache storage this session allocated (0 when nothing is cached)."""
        return 0

    def fill_random(self, length: int, generator: torch.Generator) -> None:
        """Stand in for a prefill of `length` tokens without running it (prefill=random)."""
        raise NotImplementedError(f"{type(self).__name__} keeps no cache to fill")


class CachedSession(DecodeSession):
    """A session over per-layer caches: prefill fills them, each step feeds one token."""

    def __init__(self, model, layer_caches: Sequence[LayerCache], max_len: int):
        self.model = model
        self.layer_caches = list(layer_caches)
        self.rope = model.rotary_table(max_len)
        self.max_len = max_len
        self.length = 0

    def prefill(self, prompt: torch.Tensor) -> torch.Tensor:
        logits = self.model(prompt, 0, self.layer_caches, self.rope)
        self.length = prompt.shape[1]
        return logits

    def step(self, token: torch.Tensor) -> torch.Tensor:
        if self.length >= self.max_len:
            raise ValueError(f"cache holds {self.max_len} tokens; cannot step past it")
        logits = self.model(token[:, None], self.length, self.layer_caches, self.rope)
        self.length += 1
        return logits

    @property
    def kv_cache_bytes(self) -> int:
        return sum(cache.nbytes for cache in self.layer_caches)

    def fill_random(self, length: int, generator: torch.Generator) -> None:
        """Random K/V of the right shape and dtype in positions [0, length). A decode step's time does
        not depend on the values it reads, so this measures long contexts without paying for the
        prompt (which a CPU cannot afford at 8B width and 16k tokens)."""
        for cache in self.layer_caches:
            for table in (cache.k, cache.v):
                uniform_like_normal_(table.narrow(cache.seq_dim, 0, length), 1.0, generator)
        self.length = length


class Strategy(ABC):
    """A decode strategy: what it declares it is, which kernel it runs, and the sessions it makes.

    Capabilities are class attributes, read by the harness and never inferred from a name (as
    transformers' cache layers declare `is_compileable` or `is_sliding`). Options are the keyword
    arguments of `__init__`: conf/strategy/<name>.yaml sets them, and a subclass checks its own in
    `__init__` by raising StrategyOptionError, which the runner shows as one line naming the key.
    """

    name: ClassVar[str]  # option name under conf/strategy/ and the row's `strategy`
    caches_kv: ClassVar[bool] = True  # stores K/V between steps (False only for the recompute reference)
    exact: ClassVar[bool] = True  # proven (tests/test_exactness.py) to generate the recompute reference's tokens
    devices: ClassVar[tuple[str, ...]] = ("cpu", "cuda")  # device types it can run on
    dtypes: ClassVar[tuple[str, ...]] = ("float32", "bfloat16", "float16")  # compute dtypes it can run in
    # Its attention kernels, in preference order, each with what it needs (strategies.backends): what
    # `strategy.backend` may name besides auto, and what `auto` picks from. Empty: one kernel, no choice.
    backends: ClassVar[tuple[Backend, ...]] = ()
    needs_checkpoint: ClassVar[bool] = False  # decodes only a checkpoint's weights (an engine peer): refused without model.checkpoint
    graph_capturable: ClassVar[bool] = True  # a decode step can be captured in a CUDA graph and replayed
    # A decode step traces into one torch.compile graph (fullgraph) whose shapes do not change with the
    # position: its kernels are torch ops or registered custom ops (an opaque foreign call is neither). Opt-in:
    # compile=inductor makes a point of a strategy that does not declare it a skipped row.
    compilable: ClassVar[bool] = False
    # Most sequences one session decodes one teacher-forced token at a time (an engine whose API takes
    # new tokens for several sequences only once: ONNX Runtime GenAI); None: any batch. The accuracy
    # pass runs its windows in sessions of at most this many; a timed point above it is skipped.
    forced_batch_limit: ClassVar[int | None] = None
    # An engine with its own scheduler (vLLM): a serving run hands it the whole workload through its
    # `serve_requests` (strategies.engines.served) instead of scheduling its sessions itself.
    serves_requests: ClassVar[bool] = False
    # Serving (harness.serve): a serving pool of this strategy may prefill a prompt in chunks over several
    # iterations (serving.prefill_chunk); False where the cache needs the whole prompt at once.
    chunked_prefill: ClassVar[bool] = True
    # Options that size its cache apart from the point's sequence, named when a point is too large for its
    # memory: one that caps the tokens kept (eviction's budget), ones whose value is allocated per sequence
    # whatever its length (static_full's max_len, a paged block, a full-width residual window).
    cache_cap_option: ClassVar[str | None] = None
    cache_allocation_options: ClassVar[tuple[str, ...]] = ()
    # Its decode step runs on torch's intra-op threads (torch ops and the harness's kernels, which read
    # the same count): the count a group fits to the free cores (harness.measure.threads). False: an
    # engine's own pool, sized once at its set-up.
    torch_threads: ClassVar[bool] = True

    def __init__(self, backend: str = "auto"):
        allowed = ("auto", *self.backend_names())
        if backend not in allowed:
            raise StrategyOptionError("backend", f"unknown value {backend!r}, allowed: {', '.join(allowed)}")
        self.backend = backend  # auto, or the backend a point runs (the plan resolves auto: strategies.backends)

    @classmethod
    def option_names(cls) -> tuple[str, ...]:
        """The options a YAML or `strategy.<option>=` may set (`option_defaults`)."""
        return tuple(cls.option_defaults())

    @classmethod
    def no_such_option(cls, option: str, chosen: str | None = None) -> StrategyOptionError:
        """`strategy.<option>` that this class does not take, refused with the options it does; `chosen`:
        the conf/strategy/ option the command line picked (a variant, such as h2o of eviction)."""
        named = cls.name if chosen in (None, cls.name) else f"{chosen} ({cls.name})"
        return StrategyOptionError(option, f"{named} has no option '{option}'; its options: {', '.join(cls.option_names())}")

    @classmethod
    def from_options(cls, options: dict, chosen: str | None = None) -> "Strategy":
        """The strategy a config's options build, each checked by the class (StrategyOptionError naming
        the first it refuses); one the class does not take is refused with those it does."""
        for option in options:
            if option not in cls.option_names():
                raise cls.no_such_option(option, chosen)
        try:
            return cls(**options)
        except TypeError as error:  # a value of a kind the class's own checks did not expect
            raise ConfigError("strategy", f"{cls.name} refused its options {options}: {str(error).splitlines()[0]}") from None

    @classmethod
    def backend_names(cls) -> tuple[str, ...]:
        return tuple(backend.name for backend in cls.backends)

    @classmethod
    def declared(cls, name: str) -> Backend:
        """The backend of that name."""
        return next(backend for backend in cls.backends if backend.name == name)

    @classmethod
    def option_defaults(cls) -> dict:
        """Every option `__init__` takes, `backend` included, and its default: its keyword arguments (a
        class taking more through **kwargs, as eviction's policies' parameters, adds them)."""
        signature = inspect.signature(cls.__init__).parameters.values()
        return {p.name: p.default for p in signature if p.name != "self" and p.kind == p.POSITIONAL_OR_KEYWORD}

    def options(self) -> dict:
        """The options besides `backend` this instance was built with (recorded in the point's key)."""
        return {}

    def cache_layout(self, shape: ModelConfig | None = None) -> CacheLayout | None:
        """How this strategy stores K/V for `shape` (some layouts' scale bytes depend on head_dim), for
        the analytic model; None when it stores none."""
        return CONTIGUOUS if self.caches_kv else None

    def check_layout(self, shape: ModelConfig) -> None:
        """Refuse, with StrategyOptionError, a shape this strategy cannot store K/V for at all (an engine's
        KV type whose blocks do not divide head_dim): the analytic model's check before it gives figures.
        A run does not call it: there the same shape makes a skipped row with the engine's own words."""

    def check_point(self, prefill: str, shape: ModelConfig, max_len: int) -> None:
        """Refuse, with StrategyOptionError, a point this strategy cannot mean anything at (checked
        before anything runs). Device and dtype are not refused here: they make a skipped row."""
        if prefill == "random" and not self.caches_kv:
            raise StrategyOptionError("prefill", f"random needs a cache to fill; {self.name} keeps none, use prefill=compute",
                                      top_level=True)

    def unavailable(self, device: torch.device, dtype: torch.dtype) -> str | None:
        """Why the declared devices and dtypes exclude this point, or None."""
        if device.type not in self.devices:
            return f"{self.name} runs on {', '.join(self.devices)}; this point runs on {device.type}"
        dtype_name = str(dtype).removeprefix("torch.")
        if dtype_name not in self.dtypes:
            return f"{self.name} supports {', '.join(self.dtypes)}; dtype is {dtype_name}"
        return None

    def resolve_backend(self, device: torch.device, dtype: torch.dtype, shape: ModelConfig | None = None) -> str:
        """The backend a point on this device and dtype (and model shape) runs: the plan's one call of
        strategies.backends.choose (a strategy without backends keeps `auto`). Raises
        StrategyUnavailable where the strategy or the backend asked for cannot run."""
        if not self.backends:
            reason = self.unavailable(device, dtype)
            if reason is not None:
                raise StrategyUnavailable(reason)
            return self.backend
        return choose(self, device, dtype, shape).name

    def kernel(self, device: torch.device, dtype: torch.dtype, shape: ModelConfig | None = None) -> str:
        """Name of the attention kernel a session on this device/dtype (and model shape) will run: its
        backend's (the one named, or auto's choice), recorded in the row's `kernel` column. A member
        calls it in the process that runs the point, so a named backend's needs are checked where it
        runs (a compiled kernel is loaded there). Raises StrategyUnavailable with the reason when the
        strategy cannot run here. A strategy without backends names its one kernel itself."""
        return choose(self, device, dtype, shape).kernel.format_map(self.options())

    def session_backend(self, model) -> Backend:
        """The backend a session runs: the one this strategy names (a planned point's: the plan chose it,
        and a session never chooses again), or, built with `auto` outside a plan, the choice for the
        model's device, dtype and shape."""
        if self.backend != "auto":
            return self.declared(self.backend)
        return choose(self, model.device, model.dtype, model.cfg)

    def row_columns(self) -> dict:
        """Columns the strategy reports about itself beyond what the point records (an engine's name,
        version, KV type in its words: strategies.engines.engine), merged into its row, skipped or not; {} here."""
        return {}

    def agreement(self) -> Agreement | None:
        """The bounds within which this strategy must agree with the exact reference before it is timed
        (harness.measure.agreement), for one not proven exact that claims full precision; None: none."""
        return None

    def serving_unavailable(self) -> str | None:
        """Why this strategy cannot serve a workload (harness.serve: a pool holding a changing set of
        sequences, each at its own length), or None, where sequence_memory and new_pool say how. A
        serving point of a strategy that cannot is a skipped row with this reason."""
        if not self.caches_kv:
            return f"{self.name} keeps no cache: a server recomputing every sequence has nothing to pool"
        return (f"{self.name} declares no serving pool (strategies.base.Strategy.new_pool): a serving run holds "
                "a changing set of sequences at their own lengths, which its sessions do not")

    def sequence_memory(self, shape: ModelConfig, dtype: torch.dtype) -> SequenceMemory:
        """What one sequence costs this strategy's serving pool for `shape` in `dtype`: its own
        accounting, which the scheduler admits and grows sequences by (strategies.serving)."""
        raise NotImplementedError(self.serving_unavailable())

    def new_pool(self, model, memory: SequenceMemory, budget_bytes: int, max_len: int):
        """A serving pool (strategies.caches.pools.SequencePool) holding sequences of at most `max_len`
        tokens within `budget_bytes`, placed as harness.serve.memory decides by `memory`."""
        raise NotImplementedError(self.serving_unavailable())

    @abstractmethod
    def new_session(self, model, batch: int, max_len: int) -> DecodeSession:
        """A session for `batch` sequences of at most `max_len` tokens on the model's device/dtype."""

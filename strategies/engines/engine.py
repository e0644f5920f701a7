"""A peer: an engine users deploy instead of the harness (llama.cpp, OpenVINO, ONNX Runtime GenAI),
measured as a member of a group like any strategy.

Contract, for the class of each engine member (one file per engine under strategies/engines/, one YAML
per KV type under conf/strategy/):

- Subclass `PeerStrategy` and declare, as class attributes:
  `name` (the family, e.g. llamacpp), `engine` (the engine's name in rows: llama.cpp), `package` (the
  module the engine's wheel installs, imported to check it is there; a missing one makes every member a
  skipped row whose reason is `pip install -e '.[peers]'`), `step_granularity` ("token": `step` feeds one
  token through the engine; "decode": the engine only decodes whole sequences, see below), `kv_types`
  (the values of the `kv_type` option: the harness's word -> the engine's own word for that KV type,
  e.g. "q8_0" -> "q8_0", "u8" -> "u8"), `exact_kv_types` (the kv_type values at full precision, whose
  members must agree with the harness's exact cache: AGREEMENT, checked by harness.measure.agreement),
  and `kernel_text` (the row's `kernel`, {kv_type} filled from the options).
- Implement `load_problem()` (why the engine's library cannot load here, or None: a skipped row with
  the engine's own message; called only where `package` is installed), `engine_info()` (EngineInfo:
  version, KV type in its words, the ISA its library was built for, from the engine's own system info,
  and which build it is: a wheel or one made here, with what; called only after load_problem() said
  None), and `new_session(model, batch, max_len)` returning an `EngineSession`.
- The session (`EngineSession`, below) owns what every engine shares: `prefill(prompt [B, P])` starts
  the engine's sequences afresh and runs the prompt, `step(token [B])` runs one token per sequence at
  position `length` (refused past `max_len`), `rewind(length)` drops positions >= length (warm-up and
  the passes repeat the first decode position, the accuracy pass makes a session per window chunk),
  each returning float32 CPU logits [B, V]; `kv_cache_bytes` is what max_len positions hold at the KV
  type. An engine implements three calls: `_restart()`, `_forward(ids [B, T]) -> logits [B, V]` (the
  last position's) and `_truncate(length)`.
- The weights: `engine_weights(model)` gives the model the harness runs as a float GGUF file the engine
  reads (strategies.engines.artifacts.gguf_writer, written once per checkpoint hash): never the engine's
  own quantized copy. What an engine converts it to (an IR, an ONNX folder) is an artifact too
  (strategies/engines/artifacts/), and what it loads from them is loaded once per process (`once`).
- Threads: the engine gets `torch.get_num_threads()` (the point's `threads`) when its session is made,
  and its worker threads must not spin while another member's step runs (an A/A pair of one engine
  member reads ~1.0). The count a group fits to the free cores later (harness.measure.threads) is
  torch's, not the engine's: a peer declares `torch_threads = False`.
- A KV type, shape or batch the engine cannot run at a point, or a model it cannot load: raise
  `self.refused(what, its_words)` (a StrategyUnavailable) from `new_session` with the engine's own
  words, made one line: a skipped row (harness.measure.member). A KV type the engine cannot store at a
  head_dim is also declared (KVType.block), so the analytic model refuses it before anything runs
  (`check_layout`). An engine that takes fed tokens for fewer sequences a step than the accuracy
  pass's chunk also declares `forced_batch_limit` (strategies.base.Strategy): the pass then runs its
  windows in sessions of at most that many.
- step_granularity "decode" (an engine whose API has no single-token step): its session still
  implements the protocol above so the accuracy pass and the agreement check run; its rows say
  "decode" so a reader knows each timed call covered the engine's own loop.

The harness knows a peer only by what it declares through the generic hooks of strategies.base.Strategy
(`row_columns`, `agreement`, `check_layout`): the row's engine columns and the agreement figures;
nothing in harness/ names an engine. Peers run on a CPU in float32 (the harness's exact reference dtype)
and need a checkpoint (a prompt of real text, prefill=compute): `check_point` refuses the rest in one line.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, ClassVar

import numpy as np
import torch

from harness.config import CacheLayout, ModelConfig
from strategies.backends import Backend, StrategyUnavailable
from strategies.base import Agreement, DecodeSession, Strategy, StrategyOptionError
from strategies.engines.artifacts.gguf_writer import float_gguf

GRANULARITIES = ("token", "decode")
PEERS_EXTRA = "peers"  # the project's pip extra that installs every engine's wheel
WHEEL, BUILT_HERE = "wheel", "built here"  # EngineInfo.build: the package as installed, or a build made on this machine
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")  # a terminal's colour and cursor codes, which engines put in their messages
MOST_WORDS = 400  # characters of an engine's message kept in a row's reason


@dataclass(frozen=True)
class EngineInfo:
    """What an engine says about itself, for the row."""

    version: str  # the engine's version string (its library's, e.g. llama.cpp b11739 0ce8cd1)
    kv_type: str  # the KV type in the engine's own words (f16, q8_0, u8 by channel)
    isa: str  # the instruction set its library was built for, from its own system info (AVX2, AVX512F)
    build: str  # WHEEL (its package as published) or BUILT_HERE (made on this machine)
    build_flags: str  # what the build was made with: for one made here its flags and compiler, for a wheel what it says of its own build


@dataclass(frozen=True)
class KVType:
    """One KV type of an engine: its own word for it, and how many bytes it stores."""

    word: str  # the engine's own name for it (its row's engine_kv_type before the engine is loaded)
    value_bits: int = 0  # bits per stored K or V element; 0: the compute dtype's (float32)
    block: int = 0  # elements of a row sharing one scale; 0: no scales
    scale_bytes: int = 0  # bytes of one block's scale (and offset)

    def refusal(self, head_dim: int) -> str | None:
        """Why a head this wide cannot be stored in this type's blocks (its rows are cut into whole blocks), or None."""
        if self.block and head_dim % self.block:
            return f"{self.word} stores K/V in blocks of {self.block} elements, and head_dim {head_dim} is not a multiple of {self.block}"
        return None

    def layout(self, head_dim: int) -> CacheLayout:
        scales = 2 * (head_dim // self.block) * self.scale_bytes if self.block else 0.0  # K and V, per KV head
        return CacheLayout(value_bits=self.value_bits, scale_bytes_per_token=float(scales))


# Full precision in another engine is not the harness's fp32 arithmetic: f16 K/V round at 2^-11, and
# the engines sum in other orders. These bounds hold an f16 cache on SmolLM2-135M with room (f16 KV
# measured there: rel ~3e-3, KL ~1e-5) and catch a wrong RoPE order, a wrong head layout or other
# weights (rel near 1, KL above 1).
AGREEMENT = Agreement(logit_rel=2e-2, kl_mean=1e-3)


def engine_backend(package: str, kernel: str) -> Backend:
    """The one Backend a peer declares: the engine's package (installed by the peers extra), checked like
    any backend's package, and its library loading here (PeerStrategy.load_problem)."""
    return Backend(name="engine", kernel=kernel, devices=("cpu",), dtypes=("float32",), package=package,
                   extra=PEERS_EXTRA, condition=lambda strategy, device: strategy.loads_here())


def one_line(said: object) -> str:
    """An engine's message (an exception, its log lines, a builder's output) as one line of a row's
    reason: colour codes dropped, its lines joined by ' / ' without repeats, at most MOST_WORDS long."""
    lines = [ANSI.sub("", line).strip() for line in str(said).splitlines()]
    text = " / ".join(dict.fromkeys(line for line in lines if line))
    return text if len(text) <= MOST_WORDS else text[:MOST_WORDS - 3] + "..."


_LOADED: dict[tuple, object] = {}  # what an engine loaded from its artifacts, by what it was loaded from


def once(key: tuple, load: Callable[[], object]) -> object:
    """What `load()` returns, loaded once per process for `key` (an engine's model, a compiled network):
    every member and session of the process shares it."""
    if key not in _LOADED:
        _LOADED[key] = load()
    return _LOADED[key]


class PeerStrategy(Strategy):
    """An engine's decoder with its KV type, behind the EngineSession interface (module docstring)."""

    exact = False  # nothing proves an engine generates the reference's tokens: agreement is measured
    devices = ("cpu",)
    dtypes = ("float32",)
    graph_capturable = False
    compilable = False
    torch_threads = False  # its own worker threads, sized at set-up (Threads, in this module's docstring)
    engine: ClassVar[str]  # the engine's name in rows
    package: ClassVar[str]  # the module its wheel installs
    needs_checkpoint = True  # the engine reads the checkpoint's weights, written in its format
    step_granularity: ClassVar[str] = "token"  # token | decode: what one timed call of the engine covers
    kv_types: ClassVar[dict[str, KVType]]  # kv_type option -> what the engine stores
    exact_kv_types: ClassVar[tuple[str, ...]]  # kv_type options at full precision (agreement checked)
    agreement_bounds: ClassVar[Agreement] = AGREEMENT

    def __init__(self, backend: str = "auto", kv_type: str = "f16"):
        super().__init__(backend)
        if kv_type not in self.kv_types:
            raise StrategyOptionError("kv_type", f"unknown value {kv_type!r}, allowed: {', '.join(self.kv_types)}")
        self.kv_type = kv_type  # the KV type the engine stores

    def options(self) -> dict:
        return {"kv_type": self.kv_type}

    def cache_layout(self, shape: ModelConfig | None = None) -> CacheLayout:
        kind = self.kv_types[self.kv_type]
        if shape is None and kind.block:
            raise ValueError(f"{self.name}: the scale bytes of kv_type={self.kv_type} depend on head_dim; pass the shape")
        return kind.layout(shape.resolved_head_dim if shape is not None else 1)

    def check_layout(self, shape: ModelConfig) -> None:
        head_dim = shape.resolved_head_dim
        why = self.kv_types[self.kv_type].refusal(head_dim)
        if why is not None:
            fitting = [name for name, kind in self.kv_types.items() if kind.refusal(head_dim) is None]
            raise StrategyOptionError("kv_type", f"{why}: {self.engine} refuses it; allowed at head_dim {head_dim}: "
                                      f"{', '.join(fitting)}")

    def check_point(self, prefill: str, shape: ModelConfig, max_len: int) -> None:
        if prefill != "compute":
            raise StrategyOptionError("prefill", f"{prefill}: {self.name} runs the prompt through {self.engine}, "
                                      "which has no cache to fill at random; use prefill=compute", top_level=True)
        if self.needs_checkpoint and shape.checkpoint is None:
            raise StrategyOptionError("model.checkpoint", f"{self.name} decodes a checkpoint's weights in "
                                      f"{self.engine}; set model.checkpoint (a GGUF file)", top_level=True)

    def load_problem(self) -> str | None:
        """Why the engine's library cannot load here, in the engine's words; None when it loads. Called
        only where the engine's package is installed."""
        return None

    def loads_here(self) -> str | None:
        """load_problem() where the package is installed; None otherwise (the backend's package need then
        gives the reason, the pip command)."""
        return self.load_problem() if _importable(self.package) else None

    def engine_info(self) -> EngineInfo:
        raise NotImplementedError

    def engine_weights(self, model) -> str:
        """The model the harness runs, as the float GGUF file the engine reads (written once, cached)."""
        return str(float_gguf(model.cfg.checkpoint, "F32"))

    def refused(self, what: str, said: object) -> StrategyUnavailable:
        """The skipped row's reason where the engine refuses `what` (a model, a context, a batch): its
        own words (`said`: its message, log lines or output) in one line, after the engine's name."""
        return StrategyUnavailable(f"{self.engine} {what}: {one_line(said)}")

    def row_columns(self) -> dict:
        columns = {"engine": self.engine, "step_granularity": self.step_granularity, "engine_version": None,
                   "engine_kv_type": self.kv_types[self.kv_type].word, "engine_isa": None, "engine_build": None,
                   "engine_build_flags": None}
        if _importable(self.package) and self.load_problem() is None:
            info = self.engine_info()
            columns.update(engine_version=info.version, engine_kv_type=info.kv_type, engine_isa=info.isa,
                           engine_build=info.build, engine_build_flags=info.build_flags)
        return columns

    def agreement(self) -> Agreement | None:
        return self.agreement_bounds if self.kv_type in self.exact_kv_types else None


class EngineSession(DecodeSession):
    """B sequences decoded by an engine's own forward and cache: the protocol every engine shares
    (module docstring); a subclass drives its engine through `_restart`, `_forward` and `_truncate`."""

    # What the engine raises from a session's first forward where it cannot run this model at all (a
    # kernel that refuses its head width): nothing has been timed, so it is a skipped row in its words.
    refused_at_first: ClassVar[tuple[type[Exception], ...]] = ()

    def __init__(self, strategy: PeerStrategy, batch: int, max_len: int, bytes_per_position: float):
        self.strategy = strategy  # the member: its engine's name and refusal wording
        self.batch, self.max_len, self.length = batch, max_len, 0
        self.bytes_per_position = bytes_per_position  # K and V of one position, every sequence and layer, at the KV type
        self.forwarded = False  # the engine has run a forward of this session

    def _restart(self) -> None:
        """Drop every position of every sequence: the next _forward starts at position 0."""
        raise NotImplementedError

    def _forward(self, ids: np.ndarray) -> torch.Tensor:
        """ids [B, T] at positions length.. -> float32 logits [B, V] of the last; `length` not yet moved."""
        raise NotImplementedError

    def _truncate(self, length: int) -> None:
        """Drop every position >= length of every sequence from the engine's cache."""
        raise NotImplementedError

    def prefill(self, prompt: torch.Tensor) -> torch.Tensor:
        """prompt [B, P] -> logits [B, V] of each sequence's last prompt position."""
        self._restart()
        self.length = 0
        return self._advance(prompt.cpu().numpy())

    def step(self, token: torch.Tensor) -> torch.Tensor:
        """token [B] at position `length` -> logits [B, V]."""
        if self.length >= self.max_len:
            raise ValueError(f"cache holds {self.max_len} tokens; cannot step past it")
        return self._advance(token.cpu().numpy()[:, None])

    def _advance(self, ids: np.ndarray) -> torch.Tensor:
        try:
            logits = self._forward(ids)
        except self.refused_at_first as error:
            if self.forwarded:
                raise
            raise self.strategy.refused("refused the model at its first forward", error) from None
        self.forwarded = True
        self.length += ids.shape[1]
        return logits

    def rewind(self, length: int) -> None:
        super().rewind(length)
        self._truncate(length)

    @property
    def kv_cache_bytes(self) -> int:
        """What max_len positions hold at the KV type (an engine may grow its buffer as the sequence grows,
        and its API does not say by how much)."""
        return round(self.bytes_per_position * self.max_len)


def _importable(package: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(package) is not None


def logits_tensor(values, batch: int, vocab: int) -> torch.Tensor:
    """An engine's float32 logits buffer (anything numpy or torch.frombuffer reads) as a fresh [B, V] tensor."""
    return torch.frombuffer(values, dtype=torch.float32, count=batch * vocab).view(batch, vocab).clone()


def float_bytes_per_position(model, batch: int, value_bits: int = 32, scale_bytes_per_token: float = 0.0) -> float:
    """K and V of one position of `batch` sequences in every layer, at `value_bits` per element plus the
    scales of each KV head (CacheLayout.scale_bytes_per_token, K and V together)."""
    cfg = model.cfg
    per_head = 2 * cfg.resolved_head_dim * value_bits / 8 + scale_bytes_per_token
    return batch * cfg.n_layers * cfg.n_kv_heads * per_head

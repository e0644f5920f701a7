"""A peer: an engine users deploy instead of the harness (llama.cpp, ONNX Runtime GenAI),
measured as a member of a group like any strategy.

Contract, for the class of each engine member (one file per engine under strategies/, one YAML per KV
type under conf/strategy/):

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
  the engine's own message; called only where `package` is installed), `engine_info()` (EngineInfo: version, KV type in its words, the ISA its
  library was built for, from the engine's own system info; called only after load_problem() said
  None), and `new_session(model, batch, max_len)` returning a DecodeSession that drives the engine:
  `prefill(prompt [B, P]) -> logits [B, V]`, `step(token [B]) -> logits [B, V]` (float32 CPU tensors),
  `rewind(length)` (the engine drops positions >= length: warm-up and the passes repeat the first
  decode position, the accuracy pass makes a session per window chunk), and `kv_cache_bytes`.
  The weights: `engine_weights(model)` gives the model the harness runs as a float GGUF file the engine
  reads (harness.model.gguf_writer, cached by checkpoint hash): never the engine's own quantized copy.
- Threads: the engine gets `torch.get_num_threads()` (the point's `threads`), and its worker threads
  must not spin while another member's step runs (an A/A pair of one engine member reads ~1.0).
- A KV type or batch the engine cannot run at a point: raise StrategyUnavailable from `new_session`
  with the engine's reason: a skipped row (harness.measure.member). An engine that takes fed tokens
  for fewer sequences a step than the accuracy pass's chunk also declares `forced_batch_limit`
  (strategies.base.Strategy): the pass then runs its windows in sessions of at most that many.
- step_granularity "decode" (an engine whose API has no single-token step): its session still
  implements the protocol above so the accuracy pass and the agreement check run; its rows say
  "decode" so a reader knows each timed call covered the engine's own loop.

The harness knows a peer only by what it declares through the generic hooks of strategies.base.Strategy
(`row_columns`, `agreement`): the row's engine columns and the agreement figures; nothing in harness/
names an engine. Peers run on a CPU in float32 (the harness's exact reference dtype) and need a
checkpoint (a prompt of real text, prefill=compute): `check_point` refuses the rest in one line.
"""
from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch

from harness.config import CacheLayout, ModelConfig
from harness.model.gguf_writer import float_gguf, weights_dir
from strategies.backends import Backend
from strategies.base import Agreement, Strategy, StrategyOptionError

GRANULARITIES = ("token", "decode")
PEERS_EXTRA = "peers"  # the project's pip extra that installs every engine's wheel


@dataclass(frozen=True)
class EngineInfo:
    """What an engine says about itself, for the row."""

    version: str  # the engine's version string (its library's, e.g. llama.cpp b11739 0ce8cd1)
    kv_type: str  # the KV type in the engine's own words (f16, q8_0, u8 by channel)
    isa: str  # the instruction set its library was built for, from its own system info (AVX2, AVX512F)


@dataclass(frozen=True)
class KVType:
    """One KV type of an engine: its own word for it, and how many bytes it stores."""

    word: str  # the engine's own name for it (its row's engine_kv_type before the engine is loaded)
    value_bits: int = 0  # bits per stored K or V element; 0: the compute dtype's (float32)
    block: int = 0  # elements of a row sharing one scale; 0: no scales
    scale_bytes: int = 0  # bytes of one block's scale (and offset)

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


class PeerStrategy(Strategy):
    """An engine's decoder with its KV type, behind the DecodeSession interface (module docstring)."""

    exact = False  # nothing proves an engine generates the reference's tokens: agreement is measured
    devices = ("cpu",)
    dtypes = ("float32",)
    graph_capturable = False
    compilable = False
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

    def row_columns(self) -> dict:
        columns = {"engine": self.engine, "step_granularity": self.step_granularity,
                   "engine_version": None, "engine_kv_type": self.kv_types[self.kv_type].word, "engine_isa": None}
        if _importable(self.package) and self.load_problem() is None:
            info = self.engine_info()
            columns.update(engine_version=info.version, engine_kv_type=info.kv_type, engine_isa=info.isa)
        return columns

    def agreement(self) -> Agreement | None:
        return self.agreement_bounds if self.kv_type in self.exact_kv_types else None


def _importable(package: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(package) is not None


def logits_tensor(values, batch: int, vocab: int) -> torch.Tensor:
    """An engine's float32 logits buffer (anything numpy or torch.frombuffer reads) as a fresh [B, V] tensor."""
    return torch.frombuffer(values, dtype=torch.float32, count=batch * vocab).view(batch, vocab).clone()


def transformers_model(gguf: str | Path):
    """The float GGUF copy read by transformers (which restores the q/k rows' order a GGUF file permutes),
    for the engines whose converters start from a Hugging Face model. transformers marks a model read from
    GGUF as quantized by it (a GgufHfQuantizer, which save_pretrained refuses) even though its tensors are
    dequantized to float32 on reading: the marker is dropped, so the model saves as any float one."""
    from transformers import AutoModelForCausalLM

    source = Path(gguf)
    model = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32)
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    return model


def hf_folder(gguf: str | Path) -> Path:
    """The harness's weights as a Hugging Face folder (config, safetensors, tokenizer), written once by
    transformers from the float GGUF file (transformers_model), for the engines that read such a folder
    (ONNX Runtime GenAI's builder, vLLM)."""
    source = Path(gguf)
    folder = weights_dir() / "hf" / f"{source.stem}-hf"
    if not (folder / "config.json").exists():
        from transformers import AutoTokenizer

        partial = folder.with_name(f"{folder.name}.{os.getpid()}.partial")
        transformers_model(source).save_pretrained(partial)
        AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name).save_pretrained(partial)
        publish(partial, folder)
    return folder


def publish(partial: Path, folder: Path) -> None:
    """Rename a complete folder into place (a concurrent writer's identical one may already be there)."""
    try:
        os.replace(partial, folder)
    except OSError:
        shutil.rmtree(partial, ignore_errors=True)

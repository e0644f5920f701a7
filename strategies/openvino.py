"""OpenVINO as a peer (strategies/peer.py): the model OpenVINO GenAI builds from the harness's GGUF file,
stepped one token at a time through the OpenVINO runtime, with the CPU plugin's KV cache precision.

OpenVINO GenAI's `LLMPipeline` only generates whole sequences and exposes no logits (its `logprobs`
returns the chosen token's only), so a member one token per round with logits goes one level down: the
pipeline reads the GGUF file once with `enable_save_ov_model`, which writes the stateful model it built
(`openvino_model.xml`: input_ids, attention_mask, position_ids, beam_idx in, logits out, the K/V as
state variables) beside the file, and the session compiles that model with `openvino.Core` and runs one
infer request per step. The KV type is the CPU plugin's `KV_CACHE_PRECISION` (u4 with keys quantized
by channel, `KEY_CACHE_QUANT_MODE=BY_CHANNEL`, KIVI-like); `INFERENCE_PRECISION_HINT=f32` because the
plugin computes in bf16 by default on CPUs that have it.

The weights: GenAI's GGUF reader (a preview) refuses F32 matrices ("Unsupported quantization type"), so
the engine reads the harness's weights written as F16 (harness.model.gguf_writer); the agreement check
(harness.measure.agreement) decides whether that is the harness's model.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import ClassVar

import numpy as np
import torch

from harness.model.gguf_writer import float_gguf, weights_dir
from strategies.base import DecodeSession
from strategies.peer import EngineInfo, KVType, PeerStrategy, engine_backend, logits_tensor

# The CPU plugin's quantized caches keep a scale and a zero point (f32 each) per group of a head's
# channels; the group is the head (KEY/VALUE_CACHE_GROUP_SIZE 0) and SmolLM2's heads are 64 wide.
GROUP = 64
KV_TYPES = {"f32": KVType("f32"), "f16": KVType("f16", 16),
            "u8": KVType("u8", 8, GROUP, 8), "u4": KVType("u4, keys by channel", 4, GROUP, 8)}
# kv_type -> the CPU plugin's properties that store it
KV_PROPERTIES = {"f32": {"KV_CACHE_PRECISION": "f32"}, "f16": {"KV_CACHE_PRECISION": "f16"},
                 "u8": {"KV_CACHE_PRECISION": "u8"},
                 "u4": {"KV_CACHE_PRECISION": "u4", "KEY_CACHE_QUANT_MODE": "BY_CHANNEL"}}
PREFILL_CHUNK = 256  # prompt tokens per infer: the model returns logits at every position it is fed
SEQ_AXIS = 2  # the position axis of the model's K/V state variables [B, n_kv, L, D]


class OpenVINOStrategy(PeerStrategy):
    name = "openvino"
    engine = "OpenVINO"
    package = "openvino_genai"
    step_granularity = "token"
    kv_types: ClassVar[dict[str, KVType]] = KV_TYPES
    exact_kv_types = ("f32",)
    backends = (engine_backend("openvino_genai", "OpenVINO CPU plugin ({kv_type} KV)"),)

    def __init__(self, backend: str = "auto", kv_type: str = "f32"):
        super().__init__(backend, kv_type)

    def load_problem(self) -> str | None:
        try:
            import openvino
        except ImportError as error:
            return f"openvino is not importable ({error})"
        devices = openvino.Core().available_devices
        return None if "CPU" in devices else f"OpenVINO lists no CPU device (it lists {devices})"

    def engine_info(self) -> EngineInfo:
        import openvino

        core = openvino.Core()
        capabilities = ", ".join(core.get_property("CPU", "OPTIMIZATION_CAPABILITIES"))
        # The CPU plugin compiles its kernels at run time for the host: its system info names the CPU and
        # what it can run, not a build-time instruction set.
        isa = f"JIT for the host ({core.get_property('CPU', 'FULL_DEVICE_NAME')}; {capabilities})"
        word = " ".join(f"{key}={value}" for key, value in KV_PROPERTIES[self.kv_type].items())
        return EngineInfo(version=openvino.get_version(), kv_type=word, isa=isa)

    def engine_weights(self, model) -> str:
        return str(float_gguf(model.cfg.checkpoint, "F16"))  # F32 matrices: "Unsupported quantization type"

    def properties(self) -> dict:
        """The CPU plugin's configuration for a session: the KV type, fp32 compute, the point's threads
        on one stream, no pinning (torch's threads run on the same cores between the engine's steps)."""
        return {**KV_PROPERTIES[self.kv_type], "INFERENCE_PRECISION_HINT": "f32",
                "INFERENCE_NUM_THREADS": torch.get_num_threads(), "NUM_STREAMS": 1, "PERFORMANCE_HINT": "LATENCY",
                "ENABLE_CPU_PINNING": False, "DYNAMIC_QUANTIZATION_GROUP_SIZE": 0}

    def new_session(self, model, batch: int, max_len: int) -> DecodeSession:
        compiled = _compiled(stateful_model(self.engine_weights(model)), self.properties())
        layout = self.cache_layout(model.cfg)
        bytes_per_token = batch * model.cfg.n_layers * model.cfg.n_kv_heads * (
            2 * model.cfg.resolved_head_dim * (layout.value_bits or 32) / 8 + layout.scale_bytes_per_token)
        return OpenVINOSession(compiled.create_infer_request(), batch, max_len, bytes_per_token)


class OpenVINOSession(DecodeSession):
    """One infer request of the stateful model: its state variables are the cache."""

    def __init__(self, request, batch: int, max_len: int, bytes_per_token: float):
        self.request, self.batch, self.max_len = request, batch, max_len
        self.bytes_per_token = bytes_per_token  # K/V bytes a position holds, every sequence and layer
        self.beams = np.arange(batch, dtype=np.int32)  # beam_idx: each sequence keeps its own cache
        self.length = 0

    def _infer(self, tokens: np.ndarray) -> torch.Tensor:
        """tokens [B, T] at positions length.. -> logits [B, V] of the last."""
        count = tokens.shape[1]
        positions = np.arange(self.length, self.length + count, dtype=np.int64)
        self.request.infer({"input_ids": tokens.astype(np.int64),
                            "attention_mask": np.ones((self.batch, self.length + count), dtype=np.int64),
                            "position_ids": np.broadcast_to(positions, (self.batch, count)).copy(),
                            "beam_idx": self.beams})
        self.length += count
        logits = self.request.get_tensor("logits").data  # [B, T, V]
        return logits_tensor(np.ascontiguousarray(logits[:, -1]), self.batch, logits.shape[-1])

    def prefill(self, prompt: torch.Tensor) -> torch.Tensor:
        self.request.reset_state()
        self.length = 0
        tokens = prompt.cpu().numpy()
        for start in range(0, tokens.shape[1], PREFILL_CHUNK):
            logits = self._infer(tokens[:, start:start + PREFILL_CHUNK])
        return logits

    def step(self, token: torch.Tensor) -> torch.Tensor:
        if self.length >= self.max_len:
            raise ValueError(f"cache holds {self.max_len} tokens; cannot step past it")
        return self._infer(token.cpu().numpy()[:, None])

    def rewind(self, length: int) -> None:
        super().rewind(length)
        import openvino

        for state in self.request.query_state():  # each variable read, cut at `length`, written back
            values = state.state.data  # [B, n_kv, L, D]
            state.state = openvino.Tensor(np.ascontiguousarray(values.take(range(length), axis=SEQ_AXIS)))

    @property
    def kv_cache_bytes(self) -> int:
        return int(self.bytes_per_token * self.length)


def stateful_model(gguf: str) -> Path:
    """The stateful model OpenVINO GenAI builds from `gguf`, saved once beside a link to the file in a
    folder of its own (the pipeline writes fixed names next to the file it reads)."""
    folder = weights_dir() / "openvino" / Path(gguf).stem
    xml = folder / "openvino_model.xml"
    if not xml.exists():
        import openvino_genai

        folder.mkdir(parents=True, exist_ok=True)
        link = folder / "model.gguf"
        if not link.exists():
            os.symlink(gguf, link)
        openvino_genai.LLMPipeline(str(link), "CPU", enable_save_ov_model=True)  # reads the file, writes the model
    return xml


_COMPILED: dict = {}


def _compiled(xml: Path, properties: dict):
    """The model compiled for the CPU with `properties` (once per process: compiling takes seconds)."""
    key = (str(xml), tuple(sorted(properties.items())))
    if key not in _COMPILED:
        import openvino

        core = openvino.Core()
        _COMPILED[key] = core.compile_model(core.read_model(str(xml)), "CPU", properties)
    return _COMPILED[key]

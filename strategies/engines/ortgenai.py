"""ONNX Runtime GenAI as a peer (strategies/engines/engine.py): the ONNX model its builder makes from the harness's
weights at fp32 for the CPU (strategies.engines.artifacts.ortgenai_model), one token a step through
`Generator.append_tokens`, logits read back.

The harness feeds each step's token (its own greedy loop, the same token every member gets), so a step
is `append_tokens` of one token per sequence, the engine's forward of that token, and `get_logits`.
Its CPU KV cache is the model's float32; quantized KV on a CPU needs static calibrated scales (the
builder's KV_CACHE_QUANT_SCHEMES), which is not a KV type measured here: fp32 is the one member.
A model the builder or the runtime refuses (a GGUF without a tokenizer for the builder's Hugging Face
folder, a head width its attention kernel does not take) is a skipped row with the engine's own words,
in one line.
Threads: the session's intra-op pool gets the point's torch threads, and does not spin (NO_SPINNING).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import ClassVar

import numpy as np
import torch

from strategies.base import DecodeSession
from strategies.engines.artifacts.hf_copy import NoTokenizer
from strategies.engines.artifacts.ortgenai_model import BuilderFailed, built_model
from strategies.engines.engine import (WHEEL, EngineInfo, EngineSession, KVType, PeerStrategy, engine_backend,
                                       float_bytes_per_position, logits_tensor, once)

# ONNX Runtime's own thread pool (not OpenMP) busy-waits for the next operator's work after each by
# default; between rounds that would burn the cores another member's step runs on. A session option the
# genai config passes through to AddConfigEntry: its workers sleep instead.
NO_SPINNING = {"session.intra_op.allow_spinning": "0", "session.inter_op.allow_spinning": "0"}
# ONNX Runtime's own log severity for the session: fatal only. It would print a refusal (a failed node,
# in colour) on the console as well as raise it; the raised message is the skipped row's reason.
QUIET = 4


class OrtGenAIStrategy(PeerStrategy):
    name = "ortgenai"
    engine = "ONNX Runtime GenAI"
    package = "onnxruntime_genai"
    step_granularity = "token"
    kv_types: ClassVar[dict[str, KVType]] = {"fp32": KVType("float32")}
    exact_kv_types = ("fp32",)
    # Generator.append_tokens takes new tokens for a batch above 1 once (its prompt); after that only its
    # own search advances it ("AppendTokens can only be called once for batch_size > 1"), so the harness's
    # token cannot be fed to several sequences a step
    forced_batch_limit = 1
    backends = (engine_backend("onnxruntime_genai", "ONNX Runtime CPU EP ({kv_type} KV)"),)

    def __init__(self, backend: str = "auto", kv_type: str = "fp32"):
        super().__init__(backend, kv_type)

    def engine_info(self) -> EngineInfo:
        import onnxruntime
        import onnxruntime_genai

        # onnxruntime's MLAS dispatches its kernels at run time on the CPU's features; its build names
        # only the providers it carries, its branch and commit.
        isa = f"runtime dispatch (MLAS); providers {', '.join(onnxruntime.get_available_providers())}"
        flags = f"onnxruntime wheel, {onnxruntime.get_build_info().removeprefix('ORT Build Info: ')}; MLAS kernels chosen at run time"
        return EngineInfo(version=f"onnxruntime-genai {onnxruntime_genai.__version__}, onnxruntime {onnxruntime.__version__}",
                          kv_type="float32", isa=isa, build=WHEEL, build_flags=flags)

    def new_session(self, model, batch: int, max_len: int) -> DecodeSession:
        import onnxruntime_genai as og

        if batch > self.forced_batch_limit:
            raise self.refused(f"takes a fed token for one sequence a step, not {batch}",
                               "AppendTokens can only be called once for batch_size > 1 (its own words)")
        try:
            folder = built_model(self.engine_weights(model))
        except NoTokenizer as error:
            raise self.refused("cannot be given this model (its builder reads a Hugging Face folder with the file's "
                               "tokenizer)", error) from None
        except BuilderFailed as error:
            raise self.refused("builder refused the model", error) from None
        threads = torch.get_num_threads()
        try:  # the engine's own refusal of the model, this batch or this length
            engine_model = once(("ONNX Runtime GenAI", str(folder), threads), lambda: _model(folder, threads))
            params = og.GeneratorParams(engine_model)
            params.set_search_options(max_length=max_len, batch_size=batch)
            generator = og.Generator(engine_model, params)
        except Exception as error:  # onnxruntime_genai raises its C++ errors as plain Exception/RuntimeError
            raise self.refused("refused the model", error) from None
        return OrtGenAISession(self, generator, batch, max_len, float_bytes_per_position(model, batch))


class OrtGenAISession(EngineSession):
    """One Generator: its past K/V buffers (max_len positions, allocated once) are the cache."""

    # Its attention node (GroupQueryAttention) checks the model's head width when it first runs ("head_size
    # shall be a multiple of 16"), raised as a RuntimeError from append_tokens
    refused_at_first = (RuntimeError,)

    def __init__(self, strategy: OrtGenAIStrategy, generator, batch: int, max_len: int, bytes_per_position: float):
        super().__init__(strategy, batch, max_len, bytes_per_position)  # float32 K and V (one max_length buffer)
        self.generator = generator

    def _restart(self) -> None:
        if self.length:
            self.generator.rewind_to(0)

    def _forward(self, ids: np.ndarray) -> torch.Tensor:
        """ids [B, T] at positions length.. -> logits [B, V] of the last."""
        self.generator.append_tokens(ids.astype(np.int32))
        logits = self.generator.get_logits()  # [B, 1, V] numpy
        return logits_tensor(np.ascontiguousarray(logits[:, -1], dtype=np.float32), self.batch, logits.shape[-1])

    def _truncate(self, length: int) -> None:
        self.generator.rewind_to(length)


def _model(folder: Path, threads: int):
    """The engine's model on the CPU with the point's threads."""
    import onnxruntime_genai as og

    config = og.Config(str(folder))
    config.clear_providers()  # the CPU
    config.overlay(json.dumps({"model": {"decoder": {"session_options": {
        "intra_op_num_threads": threads, "inter_op_num_threads": 1, "log_severity_level": QUIET, **NO_SPINNING}}}}))
    return og.Model(config)

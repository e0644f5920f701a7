"""ONNX Runtime GenAI as a peer (strategies/engines/engine.py): the ONNX model its builder makes from the harness's
weights at fp32 for the CPU, one token a step through `Generator.append_tokens`, logits read back.

The builder (`python -m onnxruntime_genai.models.builder -i FOLDER -o OUT -p fp32 -e cpu`) reads a Hugging
Face folder, or a float GGUF file only with the model's Hugging Face name for its configuration (a hub
this harness does not reach): the harness writes the folder itself, transformers reading its F32 GGUF copy
(harness.model.gguf_writer) and saving it, then the builder runs once; both are cached beside the file.
The harness feeds each step's token (its own greedy loop, the same token every member gets), so a step
is `append_tokens` of one token per sequence, the engine's forward of that token, and `get_logits`.
Its CPU KV cache is the model's float32; quantized KV on a CPU needs static calibrated scales (the
builder's KV_CACHE_QUANT_SCHEMES), which is not a KV type measured here: fp32 is the one member.
Threads: the session's intra-op pool gets the point's torch threads, and does not spin (NO_SPINNING).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import ClassVar

import numpy as np
import torch

from harness.model.gguf_writer import float_gguf, weights_dir
from strategies.backends import StrategyUnavailable
from strategies.base import DecodeSession
from strategies.engines.engine import EngineInfo, KVType, PeerStrategy, engine_backend, hf_folder, logits_tensor, publish

BUILT = "genai_config.json"  # the builder's last file: its presence marks a complete build
# ONNX Runtime's own thread pool (not OpenMP) busy-waits for the next operator's work after each by
# default; between rounds that would burn the cores another member's step runs on. A session option the
# genai config passes through to AddConfigEntry: its workers sleep instead.
NO_SPINNING = {"session.intra_op.allow_spinning": "0", "session.inter_op.allow_spinning": "0"}


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
        # only the providers it carries.
        isa = f"runtime dispatch (MLAS); providers {', '.join(onnxruntime.get_available_providers())}"
        return EngineInfo(version=f"onnxruntime-genai {onnxruntime_genai.__version__}, onnxruntime {onnxruntime.__version__}",
                          kv_type="float32", isa=isa)

    def new_session(self, model, batch: int, max_len: int) -> DecodeSession:
        import onnxruntime_genai as og

        if batch > self.forced_batch_limit:
            raise StrategyUnavailable(f"{self.engine} takes a fed token for one sequence a step, not {batch}: "
                                      "AppendTokens can only be called once for batch_size > 1 (its own words)")
        engine_model = _model(built_model(self.engine_weights(model)), torch.get_num_threads())
        params = og.GeneratorParams(engine_model)
        try:
            params.set_search_options(max_length=max_len, batch_size=batch)
            generator = og.Generator(engine_model, params)
        except Exception as error:  # the engine's own refusal of this batch or length
            raise StrategyUnavailable(f"{self.engine}: {error}") from error
        return OrtGenAISession(generator, batch, max_len, 2 * 4 * model.cfg.n_layers * model.cfg.n_kv_heads
                               * model.cfg.resolved_head_dim * batch)


class OrtGenAISession(DecodeSession):
    """One Generator: its past K/V buffers (max_len positions, allocated once) are the cache."""

    def __init__(self, generator, batch: int, max_len: int, bytes_per_token: int):
        self.generator, self.batch, self.max_len = generator, batch, max_len
        self.bytes_per_token = bytes_per_token  # float32 K and V of one position, every sequence and layer
        self.length = 0

    def _append(self, tokens: np.ndarray) -> torch.Tensor:
        """tokens [B, T] at positions length.. -> logits [B, V] of the last."""
        self.generator.append_tokens(tokens.astype(np.int32))
        self.length += tokens.shape[1]
        logits = self.generator.get_logits()  # [B, 1, V] numpy
        return logits_tensor(np.ascontiguousarray(logits[:, -1], dtype=np.float32), self.batch, logits.shape[-1])

    def prefill(self, prompt: torch.Tensor) -> torch.Tensor:
        if self.length:
            self.generator.rewind_to(0)
            self.length = 0
        return self._append(prompt.cpu().numpy())

    def step(self, token: torch.Tensor) -> torch.Tensor:
        if self.length >= self.max_len:
            raise ValueError(f"cache holds {self.max_len} tokens; cannot step past it")
        return self._append(token.cpu().numpy()[:, None])

    def rewind(self, length: int) -> None:
        super().rewind(length)
        self.generator.rewind_to(length)

    @property
    def kv_cache_bytes(self) -> int:
        return self.bytes_per_token * self.max_len  # the builder's CPU model shares one max_length buffer


def built_model(gguf: str) -> Path:
    """The builder's fp32 CPU model of the harness's weights (built once; a minute or so)."""
    folder = weights_dir() / "ortgenai" / f"{Path(gguf).stem}-fp32-cpu"
    if not (folder / BUILT).exists():
        source = hf_folder(gguf)
        partial = folder.with_name(f"{folder.name}.{os.getpid()}.partial")
        command = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(source), "-o", str(partial),
                   "-p", "fp32", "-e", "cpu", "-c", str(partial / "cache")]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            raise StrategyUnavailable(f"onnxruntime_genai.models.builder failed: {done.stderr.strip().splitlines()[-1:]}")
        shutil.rmtree(partial / "cache", ignore_errors=True)
        publish(partial, folder)
    return folder


_MODELS: dict = {}


def _model(folder: Path, threads: int):
    """The engine's model on the CPU with the point's threads (loaded once per process and thread count)."""
    key = (str(folder), threads)
    if key not in _MODELS:
        import onnxruntime_genai as og

        config = og.Config(str(folder))
        config.clear_providers()  # the CPU
        config.overlay(json.dumps({"model": {"decoder": {"session_options": {
            "intra_op_num_threads": threads, "inter_op_num_threads": 1, **NO_SPINNING}}}}))
        _MODELS[key] = og.Model(config)
    return _MODELS[key]

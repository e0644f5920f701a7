"""A peer whose "engine" is the harness's own decoder behind another object: the proof that the peer
infrastructure (strategies/engines/engine.py) makes an engine a member of a group, with no engine's wheel.

Its session reads the engine's copy of the weights (PeerStrategy.engine_weights: the float GGUF file
strategies.engines.artifacts.gguf_writer writes) into a decoder of its own and decodes with the contiguous cache, so it
runs the harness's numbers through the path a real engine's weights take. kv_type `f32` is its full
precision (agreement checked); `noisy` adds a planted error to every logit, which the agreement check
must catch; `missing` (FakeMissingEngine) needs a package no one installs: a skipped row.
"""
from __future__ import annotations

import torch

from harness.model import build_model
from strategies.base import DecodeSession
from strategies.backends import StrategyUnavailable
from strategies.caches.contiguous import ContiguousStrategy
from strategies.engines.engine import BUILT_HERE, EngineInfo, KVType, PeerStrategy, engine_backend


class FakeEngineSession(DecodeSession):
    def __init__(self, inner: DecodeSession, noise: float):
        self.inner, self.noise = inner, noise
        self.length = 0

    def prefill(self, prompt):
        logits = self.inner.prefill(prompt)
        self.length = self.inner.length
        return logits

    def step(self, token):
        logits = self.inner.step(token)  # [B, V]
        self.length = self.inner.length
        if not self.noise:
            return logits
        return logits + self.noise * logits.abs().max() * torch.linspace(-1, 1, logits.shape[-1])

    def rewind(self, length):
        self.inner.rewind(length)
        self.length = length

    @property
    def kv_cache_bytes(self):
        return self.inner.kv_cache_bytes


class FakeEngine(PeerStrategy):
    name = "fake_engine"
    engine = "fake"
    package = "json"  # always importable
    kv_types = {"f32": KVType("f32"), "noisy": KVType("f32 with planted noise")}
    exact_kv_types = ("f32", "noisy")
    backends = (engine_backend("json", "fake engine ({kv_type} KV)"),)
    max_batch = 8  # a batch the "engine" refuses beyond this: a skipped row with its reason

    def engine_info(self) -> EngineInfo:
        return EngineInfo(version="fake 1.0", kv_type=self.kv_types[self.kv_type].word, isa="the harness's",
                          build=BUILT_HERE, build_flags="the harness's decoder behind another object")

    def new_session(self, model, batch, max_len):
        if batch > self.max_batch:
            raise StrategyUnavailable(f"fake engine: batch {batch} > its {self.max_batch} sequences")
        engine_model = _engine_model(self.engine_weights(model), model)
        inner = ContiguousStrategy(backend="sdpa").new_session(engine_model, batch, max_len)
        return FakeEngineSession(inner, noise=0.05 if self.kv_type == "noisy" else 0.0)


class FakeMissingEngine(FakeEngine):
    name = "fake_missing_engine"
    package = "no_such_engine_module"
    backends = (engine_backend("no_such_engine_module", "missing engine"),)


_MODELS: dict = {}


def _engine_model(path: str, model):
    """The decoder over the engine's file (built once per file)."""
    if path not in _MODELS:
        import dataclasses

        shape = dataclasses.replace(model.cfg, checkpoint=path)
        _MODELS[path] = build_model(shape, model.device, model.dtype, 0, "aten")
    return _MODELS[path]

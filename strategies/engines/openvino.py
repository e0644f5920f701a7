"""OpenVINO as a peer (strategies/engines/engine.py): the plain OpenVINO runtime's CPU plugin running a stateful IR
of the harness's weights (strategies.engines.artifacts.openvino_ir), one InferRequest per session, one token per sequence a
step, logits [B, V] read back.

The KV cache is the request's state: the CPU plugin's fused attention node keeps it in the precision the
compiled model was asked for (KV_CACHE_PRECISION f32 / u8 / u4; with u4 the keys by channel where the
plugin takes KEY_CACHE_QUANT_MODE). Compute is fp32 everywhere (INFERENCE_PRECISION_HINT f32: the plugin
would otherwise run bf16 on a CPU that has it). A rewind reads each state, keeps its first `length`
positions and writes them back (the state API OpenVINO documents for trimming a stateful LLM's cache).
u4 is a skipped row on OpenVINO 2026.4.1: its CPU plugin corrupts the heap with a u4 cache (CRASHES).

Threads: INFERENCE_NUM_THREADS is the point's torch threads, one stream, no core pinning (the process's
threads are shared by every member of a group, and a pinned arena would tie the caller's thread to a
core after OpenVINO's step returned).
"""
from __future__ import annotations

from functools import lru_cache
from typing import ClassVar

import numpy as np
import torch

from harness.config import CacheLayout, ModelConfig
from strategies.backends import StrategyUnavailable
from strategies.base import DecodeSession
from strategies.engines.engine import (WHEEL, EngineInfo, EngineSession, KVType, PeerStrategy, engine_backend,
                                      float_bytes_per_position, logits_tensor, once)

# kv_type -> the CPU plugin's properties for it. u4: keys by channel (KIVI-like), the member.
KV_PROPERTIES = {"f32": {"KV_CACHE_PRECISION": "f32"},
                 "u8": {"KV_CACHE_PRECISION": "u8"},
                 "u4": {"KV_CACHE_PRECISION": "u4", "KEY_CACHE_QUANT_MODE": "BY_CHANNEL"}}
# OpenVINO 2026.4.1's CPU plugin corrupts the process's heap with a u4 KV cache once the state is
# trimmed or reset and run again: VariableState.set_state aborts in glibc ("munmap_chunk(): invalid
# pointer"), and reset_state followed by infer dies in a later infer or at exit ("corrupted size vs.
# prev_size"). A crash would take the whole group down, so the member is a skipped row saying so.
CRASHES = {"u4": "OpenVINO 2026.4.1's CPU plugin corrupts the heap with a u4 KV cache once its state is set or "
                 "reset (glibc: 'munmap_chunk(): invalid pointer' in set_state; 'corrupted size vs. prev_size' "
                 "after reset_state and infer); not run"}
BASE_PROPERTIES = {"INFERENCE_PRECISION_HINT": "f32", "NUM_STREAMS": 1, "PERFORMANCE_HINT": "LATENCY",
                   "ENABLE_CPU_PINNING": False}
STATE_PROPERTIES = ("KEY_CACHE_PRECISION", "VALUE_CACHE_PRECISION", "KEY_CACHE_QUANT_MODE")


class OpenVINOStrategy(PeerStrategy):
    name = "openvino"
    engine = "OpenVINO"
    package = "openvino"
    step_granularity = "token"
    kv_types: ClassVar[dict[str, KVType]] = {"f32": KVType("f32"), "u8": KVType("u8", value_bits=8),
                                             "u4": KVType("u4", value_bits=4)}
    exact_kv_types = ("f32",)
    backends = (engine_backend("openvino", "OpenVINO CPU plugin stateful SDPA ({kv_type} KV)"),)

    def __init__(self, backend: str = "auto", kv_type: str = "f32"):
        super().__init__(backend, kv_type)

    def cache_layout(self, shape: ModelConfig | None = None) -> CacheLayout:
        # The CPU plugin's u8/u4 keep a float32 scale and zero point per token and KV head (one group
        # of head_dim channels, its default group size) for V, and for K unless K is quantized by
        # channel (then its scales are per channel of a block of tokens: amortised, not counted here).
        kind = self.kv_types[self.kv_type]
        if not kind.value_bits:
            return CacheLayout(value_bits=0, scale_bytes_per_token=0.0)
        by_channel = self.properties().get("KEY_CACHE_QUANT_MODE") == "BY_CHANNEL"
        return CacheLayout(value_bits=kind.value_bits, scale_bytes_per_token=float(8 * (1 if by_channel else 2)))

    def properties(self, threads: int | None = None) -> dict:
        chosen = {**BASE_PROPERTIES, **KV_PROPERTIES[self.kv_type]}
        if threads is not None:
            chosen["INFERENCE_NUM_THREADS"] = threads
        return chosen

    def load_problem(self) -> str | None:
        try:
            _core()
        except Exception as error:  # the runtime's own words
            return f"OpenVINO's runtime does not load here: {error}"
        unknown = [key for key in self.properties() if key not in _supported()]
        if unknown:
            return f"OpenVINO {_version()}'s CPU plugin does not list {', '.join(unknown)} among its SUPPORTED_PROPERTIES"
        return None

    def engine_info(self) -> EngineInfo:
        accepted = _probe(tuple(sorted(self.properties().items())))
        key, value = accepted.get("KEY_CACHE_PRECISION"), accepted.get("VALUE_CACHE_PRECISION")
        words = f"{key}" if key == value else f"K {key}, V {value}"
        if self.kv_type != "f32" and accepted.get("KEY_CACHE_QUANT_MODE"):
            words += f", keys {accepted['KEY_CACHE_QUANT_MODE']}"
        return EngineInfo(version=f"OpenVINO {_version()}", kv_type=words, isa=accepted["isa"], build=WHEEL,
                          build_flags=_wheel_build())

    def new_session(self, model, batch: int, max_len: int) -> DecodeSession:
        from strategies.engines.artifacts.openvino_ir import stateful_model

        if self.kv_type in CRASHES and _version() == "2026.4.1":
            raise StrategyUnavailable(CRASHES[self.kv_type])
        xml = str(stateful_model(self.engine_weights(model)))
        properties = tuple(sorted(self.properties(torch.get_num_threads()).items()))
        try:  # compiling takes seconds: once per file and properties, a session is a request
            compiled = once(("OpenVINO", xml, properties), lambda: _core().compile_model(xml, "CPU", dict(properties)))
        except RuntimeError as error:  # the plugin's refusal of a property or the model
            raise self.refused("refused the model", str(error).strip().splitlines()[-1]) from error
        layout = self.cache_layout(model.cfg)
        return OpenVINOSession(self, compiled, batch, max_len,
                               float_bytes_per_position(model, batch, layout.value_bits or 32, layout.scale_bytes_per_token))


class OpenVINOSession(EngineSession):
    """One InferRequest: its variables are the cache of every layer."""

    def __init__(self, strategy: OpenVINOStrategy, compiled, batch: int, max_len: int, bytes_per_position: float):
        super().__init__(strategy, batch, max_len, bytes_per_position)
        self.request = compiled.create_infer_request()
        self.beam_idx = np.arange(batch, dtype=np.int32)  # every sequence keeps its own cache

    def _restart(self) -> None:
        self.request.reset_state()

    def _forward(self, ids: np.ndarray) -> torch.Tensor:
        count = ids.shape[1]
        positions = np.arange(self.length, self.length + count, dtype=np.int64)
        self.request.infer({"input_ids": ids.astype(np.int64), "attention_mask": np.ones((self.batch, self.length + count), np.int64),
                            "position_ids": np.broadcast_to(positions, (self.batch, count)).copy(), "beam_idx": self.beam_idx})
        logits = self.request.get_tensor("logits").data
        return logits_tensor(np.ascontiguousarray(logits, dtype=np.float32), self.batch, logits.shape[-1])

    def _truncate(self, length: int) -> None:
        import openvino as ov

        for state in self.request.query_state():
            kept = state.state.data[:, :, :length]  # [B, Hkv, positions, D]
            state.state = ov.Tensor(np.ascontiguousarray(kept))


@lru_cache(maxsize=1)
def _core():
    import openvino as ov

    return ov.Core()


@lru_cache(maxsize=1)
def _supported() -> tuple[str, ...]:
    return tuple(_core().get_property("CPU", "SUPPORTED_PROPERTIES")) + ("KEY_CACHE_QUANT_MODE",)


def _version() -> str:
    import openvino as ov

    return ov.get_version().split("-")[0]


@lru_cache(maxsize=1)
def _wheel_build() -> str:
    """What the wheel says of its build: its build number and commit, and what its CPU plugin can run
    (it compiles its kernels for the CPU it finds when a model is compiled: engine_isa says which)."""
    import openvino as ov

    capabilities = " ".join(_core().get_property("CPU", "OPTIMIZATION_CAPABILITIES"))
    return f"openvino wheel, build {ov.get_version()}; CPU plugin JIT at run time, capabilities {capabilities}"


@lru_cache(maxsize=None)
def _probe(properties: tuple) -> dict:
    """What the CPU plugin says it took for these properties, and the instruction set of the JIT kernels
    it generated here: a small model compiled with the same settings (its runtime model names each node's
    implementation, e.g. jit_avx512_f32; the plugin picks the ISA at run time, not at build time)."""
    import openvino as ov
    from openvino import opset13

    x = opset13.parameter([1, 64], ov.Type.f32)
    normed = opset13.mvn(opset13.softmax(opset13.multiply(x, x), 1), opset13.constant(np.array([1], np.int64)),
                         True, 1e-5, "inside_sqrt")
    compiled = _core().compile_model(ov.Model([normed], [x]), "CPU", dict(properties))
    said = {}
    for key in STATE_PROPERTIES:
        try:
            value = compiled.get_property(key)
        except RuntimeError:  # a property the compiled model does not report
            continue
        said[key] = value.to_string() if hasattr(value, "to_string") else str(value)
    kernels = {op.get_rt_info()["primitiveType"].astype(str) for op in compiled.get_runtime_model().get_ops()}
    isas = sorted({kernel.split("_")[1] for kernel in kernels if kernel.startswith("jit_")})
    said["isa"] = f"{'/'.join(isas) or 'no JIT kernel'} (CPU plugin JIT, chosen at run time)"
    return said

"""llama.cpp as a member of a group: its own decoder and KV cache, fed one token per sequence a step.

The session drives libllama through CFFI declarations of llama.h (strategies.engines.artifacts.
llamacpp_library: this machine's own build where `python -m strategies.engines.artifacts.llamacpp_build`
made one, else the `llama-cpp-py-sync` wheel's): the model the harness runs, as the float GGUF file
strategies.engines.artifacts.gguf_writer writes (the same weights, loaded once per process); a context per
session with `type_k`/`type_v` the KV type (f32, f16, q8_0, q4_0), flash attention on (llama.cpp quantizes
V only with it, and on for every KV type so they differ only by their cache), one KV stream per sequence
(`kv_unified` off: a sequence's step reads only its own cells), and `n_threads` the point's torch
threads. A prefill is one llama_decode per chunk of a sequence's prompt; a step one llama_decode of a
llama_batch holding the batch's B tokens, one per sequence id, each asking for its logits, read back
from llama_get_logits as [B, V]. A rewind removes every sequence's positions from `length` on
(llama_memory_seq_rm). No sampling: the harness takes the argmax, as for its own strategies. A model or
context llama.cpp refuses is a skipped row with the reason it logged.

Threads: both builds' ggml use OpenMP (their system info says OPENMP = 1), and libgomp resolves to the
one torch loaded first in the process, so llama.cpp's workers are the same OpenMP threads torch's ops
use: no second pool waits, spinning, while another member's step runs (the threadpool `poll` setting
belongs to ggml's non-OpenMP pool, unused in these builds).
"""
from __future__ import annotations

import numpy as np
import torch

from strategies.base import DecodeSession
from strategies.engines.artifacts.llamacpp_library import PACKAGE, Library, LibraryProblem, load
from strategies.engines.engine import EngineInfo, EngineSession, KVType, PeerStrategy, engine_backend, logits_tensor, once

# kv_type -> ggml_type enum value. q8_0/q4_0: blocks of 32 with one fp16 scale.
GGML_TYPES = {"f32": 0, "f16": 1, "q8_0": 8, "q4_0": 2}
BYTES_PER_ELEMENT = {"f32": 4.0, "f16": 2.0, "q8_0": 34 / 32, "q4_0": 18 / 32}
FLASH_ATTN_ENABLED = 1  # llama_flash_attn_type LLAMA_FLASH_ATTN_TYPE_ENABLED
PROMPT_CHUNK = 512  # prompt tokens per llama_decode call (n_batch; its ubatch is the same)
CTX_ALIGN = 256  # llama.cpp pads a context's cells to a multiple of this


class LlamaCppStrategy(PeerStrategy):
    name = "llamacpp"
    engine = "llama.cpp"
    package = PACKAGE
    kv_types = {"f32": KVType("f32"), "f16": KVType("f16", value_bits=16),
                "q8_0": KVType("q8_0", value_bits=8, block=32, scale_bytes=2),
                "q4_0": KVType("q4_0", value_bits=4, block=32, scale_bytes=2)}
    exact_kv_types = ("f32", "f16")
    backends = (engine_backend(PACKAGE, "llama.cpp llama_decode ({kv_type} KV, flash attention)"),)

    def load_problem(self) -> str | None:
        try:
            load()
        except LibraryProblem as problem:
            return f"llama.cpp's library does not load here: {problem}"
        return None

    def engine_info(self) -> EngineInfo:
        library = load()
        return EngineInfo(version=library.version, kv_type=self.kv_type, isa=library.isa, build=library.build,
                          build_flags=library.build_flags)

    def new_session(self, model, batch: int, max_len: int) -> DecodeSession:
        library, weights = load(), self.engine_weights(model)
        loaded = once(("llama.cpp", library.build, weights), lambda: self._model(library, weights))
        return LlamaCppSession(self, library, loaded, batch, max_len, torch.get_num_threads())

    def _model(self, library: Library, path: str):
        """The llama_model * of the GGUF file at `path`."""
        params = library.lib.llama_model_default_params()
        params.n_gpu_layers = 0
        mark = library.logged
        loaded = library.lib.llama_model_load_from_file(path.encode(), params)
        if loaded == library.ffi.NULL:
            raise self.refused(f"did not load {path}", library.said_since(mark))
        return loaded


class LlamaCppSession(EngineSession):
    """B sequences in one llama.cpp context, each its own sequence id and KV stream."""

    def __init__(self, strategy: LlamaCppStrategy, library: Library, model, batch: int, max_len: int, threads: int):
        lib, ffi = library.lib, library.ffi
        self.library, self.kv_type = library, strategy.kv_type
        self.vocab = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(model))
        self.layers, self.kv_width = lib.llama_model_n_layer(model), _kv_width(lib, model)
        super().__init__(strategy, batch, max_len, batch * self.layers * self.kv_width * 2 * BYTES_PER_ELEMENT[self.kv_type])
        params = lib.llama_context_default_params()
        params.n_ctx = batch * -(-max_len // CTX_ALIGN) * CTX_ALIGN
        params.n_batch = params.n_ubatch = PROMPT_CHUNK
        params.n_seq_max = batch
        params.n_threads = params.n_threads_batch = threads
        params.type_k = params.type_v = GGML_TYPES[self.kv_type]
        params.flash_attn_type = FLASH_ATTN_ENABLED
        params.kv_unified = False
        params.no_perf = True
        mark = library.logged
        self.ctx = lib.llama_init_from_model(model, params)
        if self.ctx == ffi.NULL:
            raise strategy.refused(f"refused a context of {batch} sequences of {max_len} tokens with {self.kv_type} KV",
                                   library.said_since(mark))
        self.memory = lib.llama_get_memory(self.ctx)
        self.tokens = lib.llama_batch_init(max(PROMPT_CHUNK, batch), 0, 1)
        for i in range(max(PROMPT_CHUNK, batch)):
            self.tokens.n_seq_id[i] = 1

    def __del__(self):
        lib = self.library.lib
        if getattr(self, "ctx", None) is not None and self.ctx != self.library.ffi.NULL:
            lib.llama_batch_free(self.tokens)
            lib.llama_free(self.ctx)
            self.ctx = None

    def _fill(self, tokens: np.ndarray, positions: np.ndarray, sequences: np.ndarray, outputs: np.ndarray) -> None:
        ffi, batch = self.library.ffi, self.tokens
        count = len(tokens)
        batch.n_tokens = count
        ffi.memmove(batch.token, np.ascontiguousarray(tokens, dtype=np.int32).tobytes(), 4 * count)
        ffi.memmove(batch.pos, np.ascontiguousarray(positions, dtype=np.int32).tobytes(), 4 * count)
        ffi.memmove(batch.logits, np.ascontiguousarray(outputs, dtype=np.int8).tobytes(), count)
        for i, sequence in enumerate(sequences.tolist()):
            batch.seq_id[i][0] = sequence

    def _decode(self) -> None:
        mark = self.library.logged
        result = self.library.lib.llama_decode(self.ctx, self.tokens)
        if result != 0:
            raise RuntimeError(f"llama_decode returned {result}: {self.library.said_since(mark)}")

    def _restart(self) -> None:
        self.library.lib.llama_memory_clear(self.memory, True)

    def _forward(self, ids: np.ndarray) -> torch.Tensor:
        """ids [B, T] -> logits [B, V]: one token per sequence in one llama_decode, or a prompt sequence
        by sequence in chunks of PROMPT_CHUNK."""
        if ids.shape[1] == 1:
            self._fill(ids[:, 0], np.full(self.batch, self.length), np.arange(self.batch), np.ones(self.batch, dtype=np.int8))
            self._decode()
            logits = self.library.lib.llama_get_logits(self.ctx)
            return logits_tensor(self.library.ffi.buffer(logits, 4 * self.batch * self.vocab), self.batch, self.vocab)
        rows, end = [], self.length + ids.shape[1]
        for sequence in range(self.batch):
            for start in range(0, ids.shape[1], PROMPT_CHUNK):
                chunk = ids[sequence, start: start + PROMPT_CHUNK]
                outputs = np.zeros(len(chunk), dtype=np.int8)
                outputs[-1] = self.length + start + len(chunk) == end
                first = self.length + start
                self._fill(chunk, np.arange(first, first + len(chunk)), np.full(len(chunk), sequence), outputs)
                self._decode()
            last = self.library.lib.llama_get_logits_ith(self.ctx, -1)
            rows.append(logits_tensor(self.library.ffi.buffer(last, 4 * self.vocab), 1, self.vocab))
        return torch.cat(rows)  # [B, V]

    def _truncate(self, length: int) -> None:
        self.library.lib.llama_memory_seq_rm(self.memory, -1, length, -1)

    @property
    def kv_cache_bytes(self) -> int:
        """The cells the context allocated, K and V in every layer, at the KV type's bytes."""
        cells = self.library.lib.llama_n_ctx(self.ctx)
        return round(cells * self.layers * self.kv_width * 2 * BYTES_PER_ELEMENT[self.kv_type])


def _kv_width(lib, model) -> int:
    """Elements of one token's K (or V) in one layer: KV heads x head width."""
    return lib.llama_model_n_head_kv(model) * (lib.llama_model_n_embd(model) // lib.llama_model_n_head(model))

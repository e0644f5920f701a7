"""`dynamic`: K and V per layer grown by concatenation at every call, as transformers' DynamicCache does.

Nothing is preallocated: each layer holds tables [B, n_kv, L, D] of exactly the tokens so far, and a
call with T new tokens replaces them with `torch.cat((old, new), dim=2)`, a fresh [B, n_kv, L + T, D]
tensor. So every decode step copies the whole cache once (read and write) on top of reading it for
attention, and for the copy's duration holds it twice: what the default cache of `transformers`'
`generate` costs against the preallocated `contiguous` table. Why it is measured: it is what most
users of Hugging Face models run.

The tables have `contiguous`'s layout, so attention is `contiguous`'s, with the same backends and the
same choice for `auto` (inherited from ContiguousStrategy; only the storage differs):
- `sdpa`: torch SDPA on the grouped queries (strategies.caches.attention), any device.
- `c`: decode steps through `cpu_decode_attention.c` (CPU, fp32); the prompt through SDPA.
- `auto` (default): `c` where it can run, else `sdpa`.

Not capturable in a CUDA graph (a replayed step would read a table freed after its capture), as
DynamicCache is not compileable in transformers: the class says so (`graph_capturable = False`), so
timing.cuda_graphs=true is refused before anything runs, and a capture attempted anyway raises.

`kv_cache_bytes` is what the tables hold at the end (no table is larger than its tokens); `rewind`
narrows them to the new length, as DynamicCache.crop does, and the next call's concatenation copies
only what is kept.
"""
from __future__ import annotations

import torch

from harness.config import CacheLayout
from harness.model.random_fill import uniform_like_normal_
from strategies.caches import cpu_kernel
from strategies.caches.attention import grouped_attention
from strategies.base import CachedSession
from strategies.caches.contiguous import ContiguousStrategy
from strategies.caches.pools import PerSequencePool
from strategies.serving import SEPARATE, SequenceMemory, kv_bytes_per_token


class DynamicLayerCache:
    seq_dim = 2  # position axis of k and v

    def __init__(self, batch: int, n_kv_heads: int, head_dim: int, device, dtype, decode_kernel=None):
        self.k = torch.empty(batch, n_kv_heads, 0, head_dim, device=device, dtype=dtype)  # [B, n_kv, L, D], L = 0
        self.v = torch.empty(batch, n_kv_heads, 0, head_dim, device=device, dtype=dtype)  # [B, n_kv, L, D]
        self.decode_kernel = decode_kernel  # cpu_kernel.attend_heads, or None for SDPA throughout

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def truncate(self, length: int) -> None:
        """Keep positions [0, length): views, so nothing is copied until the next concatenation."""
        self.k = self.k[:, :, :length]  # [B, n_kv, length, D]
        self.v = self.v[:, :, :length]

    def fill_random(self, length: int, generator: torch.Generator) -> None:
        """Tables of `length` random tokens, as a prefill of that many would leave."""
        batch, n_kv, _, head_dim = self.k.shape
        self.k = torch.empty(batch, n_kv, length, head_dim, device=self.k.device, dtype=self.k.dtype)
        self.v = torch.empty_like(self.k)
        uniform_like_normal_(self.k, 1.0, generator)
        uniform_like_normal_(self.v, 1.0, generator)

    def attend(self, q, k, v, start_pos):
        if self.k.is_cuda and torch.cuda.is_current_stream_capturing():
            # A captured step would read the table the capture replaced, freed once captured: every
            # replay after the first reads freed memory. Refused loudly rather than timed wrong.
            raise RuntimeError("dynamic allocates a new cache at every step (torch.cat), so its steps cannot be "
                               "replayed from CUDA graphs; run it with timing.cuda_graphs=false")
        if start_pos != self.k.shape[2]:
            raise ValueError(f"a dynamic cache of {self.k.shape[2]} tokens cannot take tokens at position {start_pos}")
        # The whole cache is copied into a new tensor, one position longer per decode step.
        self.k = torch.cat((self.k, k.transpose(1, 2)), dim=2)  # [B, n_kv, L + T, D]
        self.v = torch.cat((self.v, v.transpose(1, 2)), dim=2)
        if q.shape[1] == 1 and self.decode_kernel is not None:
            return self.decode_kernel(q, self.k, self.v, self.k.shape[2])
        return grouped_attention(q, self.k, self.v, q_offset=start_pos)


class DynamicSession(CachedSession):
    def rewind(self, length: int) -> None:
        super().rewind(length)
        for cache in self.layer_caches:
            cache.truncate(length)

    def fill_random(self, length: int, generator: torch.Generator) -> None:
        for cache in self.layer_caches:
            cache.fill_random(length, generator)
        self.length = length


class DynamicStrategy(ContiguousStrategy):
    """ContiguousStrategy's backends, kernels and `auto`; DynamicCache's storage."""

    name = "dynamic"
    graph_capturable = False  # refused before anything runs with timing.cuda_graphs=true
    compilable = False  # its tables grow every step: a new shape, a new graph, per position

    def cache_layout(self, shape=None) -> CacheLayout:
        return CacheLayout(copies_per_step=True)

    def sequence_memory(self, shape, dtype) -> SequenceMemory:
        """Exactly the tokens it holds, its own tables, grown by concatenation (the copy a step makes is
        transient and not counted)."""
        return SequenceMemory(kv_bytes_per_token(shape, dtype), SEPARATE)

    def new_pool(self, model, memory, budget_bytes, max_len) -> PerSequencePool:
        return PerSequencePool(self, model, max_len, self.kernel(model.device, model.dtype, model.cfg))

    def new_session(self, model, batch: int, max_len: int) -> DynamicSession:
        c = model.cfg
        decode_kernel = cpu_kernel.attend_heads if self.session_backend(model).name == "c" else None
        caches = [DynamicLayerCache(batch, c.n_kv_heads, c.resolved_head_dim, model.device, model.dtype, decode_kernel)
                  for _ in range(c.n_layers)]
        return DynamicSession(model, caches, max_len)

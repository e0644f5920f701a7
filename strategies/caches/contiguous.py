"""`contiguous`: K and V preallocated per layer as [B, n_kv, max_len, D] and written in place.

The table is allocated once for the longest sequence a session will reach, so no step allocates or
copies it; a step writes one position and attends over the filled prefix [0, length).

Attention kernels (`strategy.backend`; BACKENDS, in preference order, says what each needs):
- `c`: decode steps through `cpu_decode_attention.c` (CPU, fp32; strategies.caches.cpu_kernel), which reads
  the cache faster than SDPA's CPU kernel (conf/sweep/attention_backends.yaml times the two); the
  prompt still goes through SDPA.
  Where the kernel cannot run, the point is skipped with the reason.
- `sdpa`: torch's scaled_dot_product_attention on the grouped queries (strategies.caches.attention), any device.
- `auto` (default): `c` where it can run, else `sdpa` (strategies.backends). Rows name the kernel that ran.
"""
from __future__ import annotations

import torch

from strategies.caches import cpu_kernel
from strategies.caches.attention import KERNEL_NAME as SDPA_KERNEL
from strategies.caches.attention import grouped_attention
from strategies.backends import Backend
from strategies.base import CachedSession, Strategy

C_KERNEL = f"{cpu_kernel.KERNEL_NAME} for decode steps, {SDPA_KERNEL} for the prompt"
BACKENDS = (Backend("c", C_KERNEL, compiled=cpu_kernel.CONTIGUOUS_KERNEL), Backend("sdpa", SDPA_KERNEL))


class ContiguousLayerCache:
    seq_dim = 2  # position axis of k and v

    def __init__(self, batch: int, n_kv_heads: int, max_len: int, head_dim: int, device, dtype,
                 decode_kernel=None):
        # zeros, not empty: the pages are touched now, so the table is resident from the start, as a
        # serving engine's would be, and the memory peak shows it whatever the context.
        self.k = torch.zeros(batch, n_kv_heads, max_len, head_dim, device=device, dtype=dtype)  # [B, n_kv, S, D]
        self.v = torch.zeros(batch, n_kv_heads, max_len, head_dim, device=device, dtype=dtype)  # [B, n_kv, S, D]
        # decode_kernel(q [B, 1, H, D], k, v, end) -> [B, 1, H, D] for decode steps (cpu_kernel.attend_heads),
        # or None for SDPA throughout
        self.decode_kernel = decode_kernel

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def write(self, k, v, start_pos: int) -> int:
        """Store the new tokens' k/v [B, T, n_kv, D] at start_pos..; returns the filled length."""
        end = start_pos + k.shape[1]
        self.k[:, :, start_pos:end] = k.transpose(1, 2)  # -> [B, n_kv, T, D]
        self.v[:, :, start_pos:end] = v.transpose(1, 2)
        return end

    def attend(self, q, k, v, start_pos):
        end = self.write(k, v, start_pos)
        if q.shape[1] == 1 and self.decode_kernel is not None:
            return self.decode_kernel(q, self.k, self.v, end)
        return grouped_attention(q, self.k[:, :, :end], self.v[:, :, :end], q_offset=start_pos)


class ContiguousStrategy(Strategy):
    name = "contiguous"
    backends = BACKENDS
    compilable = True  # the C kernel is a torch operator, which a compiled graph calls (strategies.caches.cpu_kernel)

    def new_session(self, model, batch: int, max_len: int) -> CachedSession:
        c = model.cfg
        decode_kernel = cpu_kernel.attend_heads if self.session_backend(model).name == "c" else None
        caches = [
            ContiguousLayerCache(batch, c.n_kv_heads, max_len, c.resolved_head_dim, model.device, model.dtype,
                                 decode_kernel)
            for _ in range(c.n_layers)
        ]
        return CachedSession(model, caches, max_len)

"""`contiguous`: K and V preallocated per layer as [B, n_kv, max_len, D] and written in place.

The table is allocated once for the longest sequence a session will reach, so no step allocates or
copies it; a step writes one position and attends over the filled prefix [0, length).
"""
from __future__ import annotations

import torch

from strategies.attention import KERNEL_NAME, grouped_attention
from strategies.base import CachedSession, Strategy


class ContiguousLayerCache:
    seq_dim = 2  # position axis of k and v
    def __init__(self, batch: int, n_kv_heads: int, max_len: int, head_dim: int, device, dtype):
        # zeros, not empty: the pages are touched now, so the table is resident from the start, as a
        # serving engine's would be, and the memory peak shows it whatever the context.
        self.k = torch.zeros(batch, n_kv_heads, max_len, head_dim, device=device, dtype=dtype)  # [B, n_kv, S, D]
        self.v = torch.zeros(batch, n_kv_heads, max_len, head_dim, device=device, dtype=dtype)  # [B, n_kv, S, D]

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
        return grouped_attention(q, self.k[:, :, :end], self.v[:, :, :end], q_offset=start_pos)


class ContiguousStrategy(Strategy):
    def __init__(self, name: str = "contiguous", backend: str = "auto"):
        super().__init__(name, backend)

    def kernel(self, device, dtype) -> str:
        return KERNEL_NAME

    def new_session(self, model, batch: int, max_len: int) -> CachedSession:
        c = model.cfg
        caches = [
            ContiguousLayerCache(batch, c.n_kv_heads, max_len, c.resolved_head_dim, model.device, model.dtype)
            for _ in range(c.n_layers)
        ]
        return CachedSession(model, caches, max_len)

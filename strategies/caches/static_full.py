"""`static_full`: a preallocated table, attended over all max_len positions under a mask every step.

The storage is `contiguous`'s: K and V per layer as [B, n_kv, max_len, D], zeroed up front and written
in place. What differs is the read: instead of slicing the filled prefix, attention runs over every one
of the max_len positions with a boolean mask that hides the unfilled ones (and, in the prompt, the
future ones), as transformers' StaticCache does with SDPA: its shapes never change, which is what lets
the step be compiled or captured once, and it pays by reading the whole table at every step however
short the sequence is. Why it is measured: that price, against `contiguous`, at short contexts in long
tables: `strategy.max_len` preallocates that many positions (transformers' max_cache_len) whatever the
point's length, so `max_len=4 * (ctx + decode_tokens)` measures a table filled to a quarter.

Exact: a masked position's score is -inf, its softmax weight exactly 0, and the table is zeroed, so
unfilled rows add nothing (a NaN there would: 0 * NaN is NaN). The mask is built once per forward pass
and shared by the layers, as transformers builds its causal mask once per forward.

Attention kernels (`strategy.backend`), both over all max_len positions:
- `sdpa`: torch SDPA on the grouped queries (no K/V repeat, as strategies.caches.attention) with the boolean
  mask, any device: what StaticCache runs.
- `c`: decode steps through `cpu_decode_attention.c` (CPU, fp32; strategies.caches.cpu_kernel) told to read
  all max_len rows and give the unwritten ones weight exactly 0, so the step reads what SDPA's does at
  the rate the contiguous cache's reads run; the prompt still goes through SDPA with the mask. Where
  the kernel cannot run, the point is skipped with the reason.
- `auto` (default): `c` where it can run, else `sdpa` (strategies.backends). Rows name the kernel that ran.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from harness.config import CacheLayout
from strategies.caches import cpu_kernel
from strategies.backends import Backend
from strategies.base import CachedSession, Strategy, StrategyOptionError
from strategies.caches.contiguous import ContiguousLayerCache

KERNEL_NAME = "torch.sdpa(grouped q, no K/V repeat) over all max_len positions with a boolean mask"
C_KERNEL = (f"{cpu_kernel.KERNEL_NAME} over all max_len positions, unwritten ones weighted 0, for decode "
            f"steps; {KERNEL_NAME} for the prompt")
BACKENDS = (Backend("c", C_KERNEL, compiled=cpu_kernel.CONTIGUOUS_KERNEL), Backend("sdpa", KERNEL_NAME))


class FullLengthMask:
    """The boolean mask [G*T, max_len] of one forward pass, built by its first layer, reused by the rest."""

    def __init__(self, max_len: int, device):
        self.key_positions = torch.arange(max_len, device=device)  # [max_len]
        self.key = None  # (start_pos, seq_len, group) of the mask held
        self.mask = None

    def get(self, start_pos: int, seq_len: int, group: int) -> torch.Tensor:
        # Under torch.compile the mask is built in the graph every step (a few small ops): one cached on
        # this object would be a guard on its key, and a recompilation per position.
        if torch.compiler.is_compiling():
            return self.build(start_pos, seq_len, group)
        if self.key != (start_pos, seq_len, group):
            self.mask, self.key = self.build(start_pos, seq_len, group), (start_pos, seq_len, group)
        return self.mask

    def build(self, start_pos: int, seq_len: int, group: int) -> torch.Tensor:
        # Row (g, t) is the query at position start_pos + t: it sees keys 0 .. start_pos + t, which
        # also hides every position not yet written.
        query_pos = (torch.arange(seq_len, device=self.key_positions.device) + start_pos).repeat(group)  # [G*T]
        return self.key_positions[None, :] <= query_pos[:, None]  # [G*T, max_len]


def attend_whole_table(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, end: int) -> torch.Tensor:
    """The C kernel over every row of the table, those from `end` on (not yet written) weighted 0."""
    return cpu_kernel.attend_heads(q, k, v, k.shape[2], visible=end)


class StaticFullLayerCache(ContiguousLayerCache):
    def __init__(self, batch, n_kv_heads, max_len, head_dim, device, dtype, mask: FullLengthMask,
                 decode_kernel=None):
        super().__init__(batch, n_kv_heads, max_len, head_dim, device, dtype, decode_kernel)
        self.full_length_mask = mask

    def attend(self, q, k, v, start_pos):
        end = self.write(k, v, start_pos)
        batch, seq_len, n_heads, head_dim = q.shape
        if seq_len == 1 and self.decode_kernel is not None:
            return self.decode_kernel(q, self.k, self.v, end)
        n_kv = self.k.shape[1]
        group = n_heads // n_kv
        q_grouped = (
            q.view(batch, seq_len, n_kv, group, head_dim)
            .permute(0, 2, 3, 1, 4)
            .reshape(batch, n_kv, group * seq_len, head_dim)
        )  # [B, n_kv, G*T, D], rows ordered (g, t) as in grouped_attention
        mask = self.full_length_mask.get(start_pos, seq_len, group)  # [G*T, max_len]
        out = F.scaled_dot_product_attention(q_grouped, self.k, self.v, attn_mask=mask)  # [B, n_kv, G*T, D]
        return (
            out.view(batch, n_kv, group, seq_len, head_dim)
            .permute(0, 3, 1, 2, 4)
            .reshape(batch, seq_len, n_heads, head_dim)
        )


class StaticFullStrategy(Strategy):
    name = "static_full"
    backends = BACKENDS
    # Fixed shapes are the layout's reason to exist: one graph for every position. The C kernel is the
    # operator harness_kernels::decode_attention, eager and compiled alike (strategies.caches.cpu_kernel).
    compilable = True

    def __init__(self, backend: str = "auto", max_len: int | None = None):
        super().__init__(backend)
        if max_len is not None and (isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 1):
            raise StrategyOptionError("max_len", f"must be a positive integer or null, got {max_len!r}")
        self.max_len = max_len  # positions preallocated per sequence; None: exactly the point's ctx + decode_tokens

    def options(self) -> dict:
        return {"max_len": self.max_len}

    def serving_unavailable(self) -> str | None:
        return ("static_full reads its whole preallocated table under a mask every step; its serving form (a "
                "reservation read over every reserved row) is not built: contiguous serves the reservation")

    def cache_layout(self, shape=None) -> CacheLayout:
        return CacheLayout(reads_max_len=True, preallocated_tokens=self.max_len or 0)

    def check_point(self, prefill: str, shape, max_len: int) -> None:
        super().check_point(prefill, shape, max_len)
        if self.max_len is not None and self.max_len < max_len:
            raise StrategyOptionError("max_len", f"{self.max_len} cannot hold the point's ctx + decode_tokens = {max_len}")

    def new_session(self, model, batch: int, max_len: int) -> CachedSession:
        c = model.cfg
        max_len = max(max_len, self.max_len or 0)  # the table StaticCache would allocate (max_cache_len)
        mask = FullLengthMask(max_len, model.device)
        use_c = self.session_backend(model).name == "c"
        caches = [StaticFullLayerCache(batch, c.n_kv_heads, max_len, c.resolved_head_dim, model.device, model.dtype,
                                       mask, attend_whole_table if use_c else None)
                  for _ in range(c.n_layers)]
        return CachedSession(model, caches, max_len)

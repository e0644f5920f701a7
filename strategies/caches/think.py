"""`think`: keys stored at a kept fraction of their channels, chosen once at the end of prefill by
query-key magnitude (ThinK, Xu et al. 2024). Values keep every channel. Approximate (`exact = False`).

At the end of prefill each sequence and KV head ranks its key channels c by
    (sum over the group's query heads of ||Q[-window:, c]||) * ||K[:, c]||,
the norms over the last `window` prompt queries (32, the observation window ThinK shares with SnapKV)
and over every prompt key, and keeps the top round(keep_fraction * head_dim). ThinK prunes 40% of the
key channels at small loss (keep_fraction 0.6): a 20% cut of the K/V bytes. Every key written after
that, generated tokens' too, is stored at those channels (a table of kept-wide rows) and read at that
width, and a decode step takes the query at them: the dot products skip the dropped channels, the
softmax scale stays 1/sqrt(head_dim).

The prompt attends over its full keys (the selection needs them all; the papers compress after the
prompt's forward, as kvpress does), then stores the kept channels. Positions: a preallocated table
per layer as `contiguous`, so `rewind` needs nothing beyond the length.

Decode kernels (strategy.backend; BACKENDS, `auto` the first that can run):
- `c` (CPU, fp32): `cpu_pruned_attention.c` (strategies.caches.compacted_kernel), the exact decode
  kernel reading the kept-wide key rows, the query's kept channels picked per (sequence, KV head)
  inside it, the step's row written in the same call. Its fixed-width path reads a key row on into the
  next (against zeros), so the key table is allocated with head_dim - kept floats after its last row
  (outside `nbytes`: a few hundred bytes a layer).
- `torch` (any device): the query gathered at the kept channels, then torch SDPA.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from harness.config import CacheLayout, ModelConfig
from strategies.caches import compacted_kernel
from strategies.caches.attention import KERNEL_NAME as SDPA_KERNEL
from strategies.caches.attention import grouped_attention
from strategies.backends import Backend
from strategies.base import CachedSession, Strategy, StrategyOptionError

BACKENDS = (Backend("c", f"{compacted_kernel.PRUNED_KERNEL.name}, keys read at the kept channels, for decode steps; "
                         f"{SDPA_KERNEL} for the prompt", compiled=compacted_kernel.PRUNED_KERNEL),
            Backend("torch", f"query gathered at the kept key channels + torch.sdpa; {SDPA_KERNEL} for the prompt"))


class PrunedKeyLayerCache:
    seq_dim = 2  # position axis of k and v

    def __init__(self, batch: int, n_kv: int, max_len: int, head_dim: int, kept: int, window: int, device, dtype,
                 kernel: bool = False):
        # zeros, not empty: resident from the start, as contiguous's tables are; the margin after the key
        # table's rows is the C kernel's (module docstring)
        margin = head_dim - kept
        self.k = torch.zeros(batch * n_kv * max_len * kept + margin, device=device, dtype=dtype)[:-margin or None].view(
            batch, n_kv, max_len, kept)  # [B, n_kv, S, kept]
        self.v = torch.zeros(batch, n_kv, max_len, head_dim, device=device, dtype=dtype)  # [B, n_kv, S, D]
        # the kept channels of each sequence and KV head, ascending [B, n_kv, kept] (the first until a prefill)
        self.channels = torch.arange(kept, device=device).expand(batch, n_kv, kept).contiguous()
        self.window, self.scale = window, head_dim ** -0.5
        self.kernel = kernel  # decode steps through cpu_pruned_attention.c, else the query gathered + SDPA

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes + self.channels.nbytes

    def _choose_channels(self, q: torch.Tensor, k: torch.Tensor) -> None:
        """q [B, P, H, D], k [B, n_kv, P, D]: ThinK's query-key magnitude per channel (module docstring)."""
        batch, _, n_heads, head_dim = q.shape
        n_kv = k.shape[1]
        observed = q[:, -self.window:].float()  # [B, w, H, D]
        query_norm = observed.norm(dim=1).view(batch, n_kv, n_heads // n_kv, head_dim).sum(2)  # [B, n_kv, D]
        key_norm = k.float().norm(dim=2)  # [B, n_kv, D]
        kept = self.k.shape[-1]
        self.channels = (query_norm * key_norm).topk(kept, dim=-1).indices.sort(dim=-1).values

    def _pruned(self, k: torch.Tensor) -> torch.Tensor:
        """k [B, n_kv, T, D] -> its kept channels [B, n_kv, T, kept]."""
        return k.gather(-1, self.channels[:, :, None, :].expand(*k.shape[:3], -1))

    def attend(self, q, k, v, start_pos):
        batch, _, n_heads, head_dim = q.shape
        n_kv = k.shape[2]
        if q.shape[1] == 1 and self.kernel:
            grouped = q.reshape(batch, n_kv, n_heads // n_kv, head_dim)  # [B, n_kv, G, D]
            out = compacted_kernel.pruned_key_attention(grouped, k[:, 0], v[:, 0], self.k, self.v, self.channels,
                                                        start_pos)
            return out.view(batch, 1, n_heads, head_dim)
        k, v = k.transpose(1, 2), v.transpose(1, 2)  # [B, n_kv, T, D]
        end = start_pos + q.shape[1]
        if q.shape[1] > 1:
            if start_pos != 0:
                raise ValueError("think takes several tokens at once only as the prompt, at position 0")
            self._choose_channels(q, k)
            self.k[:, :, :end] = self._pruned(k)
            self.v[:, :, :end] = v
            return grouped_attention(q, k, v, q_offset=0)
        self.k[:, :, start_pos:end] = self._pruned(k)
        self.v[:, :, start_pos:end] = v
        grouped = q.view(batch, n_kv, n_heads // n_kv, head_dim)  # [B, n_kv, G, D]
        gathered = grouped.gather(-1, self.channels[:, :, None, :].expand(-1, -1, grouped.shape[2], -1))  # [B, n_kv, G, kept]
        out = F.scaled_dot_product_attention(gathered, self.k[:, :, :end], self.v[:, :, :end], scale=self.scale)
        return out.view(q.shape)  # [B, n_kv, G, D] -> [B, 1, H, D]


class ThinKStrategy(Strategy):
    name = "think"
    exact = False  # the dropped key channels move the scores; the harness measures by how much
    backends = BACKENDS

    def __init__(self, backend: str = "auto", keep_fraction: float = 0.6, window: int = 32):
        super().__init__(backend)
        if isinstance(keep_fraction, bool) or not isinstance(keep_fraction, (int, float)) or not 0 < keep_fraction <= 1:
            raise StrategyOptionError("keep_fraction", f"must be a number in (0, 1], got {keep_fraction!r}")
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise StrategyOptionError("window", f"must be an integer >= 1, got {window!r}")
        self.keep_fraction, self.window = float(keep_fraction), window

    def options(self) -> dict:
        return {"keep_fraction": self.keep_fraction, "window": self.window}

    def kept_channels(self, head_dim: int) -> int:
        return max(1, round(self.keep_fraction * head_dim))

    def cache_layout(self, shape: ModelConfig | None = None) -> CacheLayout:
        if shape is None:
            raise ValueError("think: the kept key channels depend on head_dim; pass the model shape")
        return CacheLayout(key_channels_kept=self.kept_channels(shape.resolved_head_dim))

    def new_session(self, model, batch: int, max_len: int) -> CachedSession:
        c = model.cfg
        kept = self.kept_channels(c.resolved_head_dim)
        kernel = self.session_backend(model).name == "c"
        caches = [PrunedKeyLayerCache(batch, c.n_kv_heads, max_len, c.resolved_head_dim, kept, self.window,
                                      model.device, model.dtype, kernel)
                  for _ in range(c.n_layers)]
        return CachedSession(model, caches, max_len)

"""`flash`: FlashAttention over a preallocated cache. CUDA and fp16/bf16 only.

Two backends, chosen with `strategy.backend` (BACKENDS, in preference order, says what each needs):
- `flash_attn`: `flash_attn.flash_attn_with_kvcache` (the flash_attn package). Cache layout
  [B, S, n_kv, D]; the kernel appends the new K/V at `cache_seqlens` in place and attends in the same
  launch. GQA is native.
- `torch`: PyTorch's bundled FlashAttention through SDPA with every other backend disabled, so the
  call fails rather than silently running another kernel (a torch build with it, compute capability
  8.0 or more). Cache layout [B, n_kv, S, D].
`auto` takes the first that can run (strategies.backends). Where neither can (any CPU), the strategy is
unavailable and the runner records the point as skipped with the reason; it never substitutes
another kernel.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from strategies.backends import Backend
from strategies.base import CachedSession, Strategy
from strategies.caches.contiguous import ContiguousLayerCache


class FlashAttnLayerCache:
    """Cache driven by flash_attn_with_kvcache: the kernel writes the new K/V itself."""

    seq_dim = 1  # position axis of k and v

    def __init__(self, batch, n_kv_heads, max_len, head_dim, device, dtype):
        from flash_attn import flash_attn_with_kvcache  # optional: the flash extra, imported only where it runs

        self.kernel = flash_attn_with_kvcache
        self.k = torch.zeros(batch, max_len, n_kv_heads, head_dim, device=device, dtype=dtype)  # [B, S, n_kv, D]
        self.v = torch.zeros(batch, max_len, n_kv_heads, head_dim, device=device, dtype=dtype)  # [B, S, n_kv, D]
        self.seqlens = torch.zeros(batch, dtype=torch.int32, device=device)  # [B] filled length per sequence

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def attend(self, q, k, v, start_pos):
        self.seqlens.fill_(start_pos)
        # q [B, T, H, D], k/v [B, T, n_kv, D]: already the kernel's layout. causal=True aligns the
        # T new queries to the bottom right of the (start_pos + T)-key window.
        return self.kernel(q, self.k, self.v, k=k, v=v, cache_seqlens=self.seqlens, causal=True)


class TorchFlashLayerCache(ContiguousLayerCache):
    """The contiguous table [B, n_kv, S, D]; attention by SDPA restricted to FLASH_ATTENTION."""

    def __init__(self, batch, n_kv_heads, max_len, head_dim, device, dtype):
        super().__init__(batch, n_kv_heads, max_len, head_dim, device, dtype)
        self.only_flash = lambda: sdpa_kernel([SDPBackend.FLASH_ATTENTION])

    def attend(self, q, k, v, start_pos):
        seq_len = q.shape[1]
        if seq_len > 1 and start_pos > 0:
            # SDPA's is_causal aligns top-left; chunked prefill would need bottom-right alignment.
            raise ValueError("torch flash backend: multi-token steps only from position 0")
        end = self.write(k, v, start_pos)
        with self.only_flash():
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2),  # [B, H, T, D]
                self.k[:, :, :end],  # [B, n_kv, end, D]
                self.v[:, :, :end],
                is_causal=seq_len > 1,
                enable_gqa=True,
            )  # [B, H, T, D]
        return out.transpose(1, 2)


def torch_flash_unavailable(strategy: Strategy, device: torch.device) -> str | None:
    """Why torch's bundled FlashAttention cannot run on `device` (a CUDA device), or None."""
    if not getattr(torch.backends.cuda, "is_flash_attention_available", lambda: True)():
        return "this torch build has no FlashAttention SDPA kernel"
    major, _ = torch.cuda.get_device_capability(device)
    if major < 8:
        return f"torch's FlashAttention needs compute capability >= 8.0, device has {major}.x"
    return None


BACKENDS = (Backend("flash_attn", "flash_attn.flash_attn_with_kvcache", package="flash_attn", extra="flash"),
            Backend("torch", "torch.sdpa[FLASH_ATTENTION]", condition=torch_flash_unavailable))
LAYER_CACHES = {"flash_attn": FlashAttnLayerCache, "torch": TorchFlashLayerCache}


class FlashStrategy(Strategy):
    name = "flash"
    devices = ("cuda",)  # FlashAttention kernels exist for CUDA only
    dtypes = ("bfloat16", "float16")  # and for the half-precision types only
    backends = BACKENDS

    def new_session(self, model, batch: int, max_len: int) -> CachedSession:
        layer_cache = LAYER_CACHES[self.session_backend(model).name]
        c = model.cfg
        caches = [
            layer_cache(batch, c.n_kv_heads, max_len, c.resolved_head_dim, model.device, model.dtype)
            for _ in range(c.n_layers)
        ]
        return CachedSession(model, caches, max_len)

"""`flash`: FlashAttention over a preallocated cache. CUDA and fp16/bf16 only.

Two backends, chosen with `strategy.backend`:
- `flash_attn`: `flash_attn.flash_attn_with_kvcache`. Cache layout [B, S, n_kv, D]; the kernel appends
  the new K/V at `cache_seqlens` in place and attends in the same launch. GQA is native.
- `torch`: PyTorch's bundled FlashAttention through SDPA with every other backend disabled, so the
  call fails rather than silently running another kernel. Cache layout [B, n_kv, S, D].
`auto` takes the first that can run. Where neither can (any CPU), the strategy is unavailable and the
runner records the point as skipped with the reason; it never substitutes another kernel.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from strategies.base import CachedSession, Strategy, StrategyUnavailable
from strategies.contiguous import ContiguousLayerCache

BACKENDS = ("flash_attn", "torch")
KERNELS = {
    "flash_attn": "flash_attn.flash_attn_with_kvcache",
    "torch": "torch.sdpa[FLASH_ATTENTION]",
}


class FlashAttnLayerCache:
    """Cache driven by flash_attn_with_kvcache: the kernel writes the new K/V itself."""

    seq_dim = 1  # position axis of k and v

    def __init__(self, batch, n_kv_heads, max_len, head_dim, device, dtype):
        from flash_attn import flash_attn_with_kvcache

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
        from torch.nn.attention import SDPBackend, sdpa_kernel

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


LAYER_CACHES = {"flash_attn": FlashAttnLayerCache, "torch": TorchFlashLayerCache}


def backend_unavailable(backend: str, device: torch.device) -> str | None:
    """Why `backend` cannot run on `device`, or None when it can."""
    if backend == "flash_attn":
        try:
            import flash_attn  # noqa: F401
        except ImportError as error:
            return f"flash_attn is not importable ({error}); install the extra: pip install -e '.[flash]'"
        return None
    available = getattr(torch.backends.cuda, "is_flash_attention_available", lambda: True)()
    if not available:
        return "this torch build has no FlashAttention SDPA kernel"
    major, _ = torch.cuda.get_device_capability(device)
    if major < 8:
        return f"torch's FlashAttention needs compute capability >= 8.0, device has {major}.x"
    return None


class FlashStrategy(Strategy):
    name = "flash"
    devices = ("cuda",)  # FlashAttention kernels exist for CUDA only
    dtypes = ("bfloat16", "float16")  # and for the half-precision types only
    backends = BACKENDS

    def resolve_backend(self, device: torch.device, dtype: torch.dtype, shape=None) -> str:
        super().resolve_backend(device, dtype, shape)
        candidates = BACKENDS if self.backend == "auto" else (self.backend,)
        reasons = []
        for backend in candidates:
            reason = backend_unavailable(backend, device)
            if reason is None:
                return backend
            reasons.append(f"{backend}: {reason}")
        raise StrategyUnavailable("; ".join(reasons))

    def kernel(self, device, dtype, shape=None) -> str:
        return KERNELS[self.resolve_backend(device, dtype)]

    def new_session(self, model, batch: int, max_len: int) -> CachedSession:
        layer_cache = LAYER_CACHES[self.resolve_backend(model.device, model.dtype)]
        c = model.cfg
        caches = [
            layer_cache(batch, c.n_kv_heads, max_len, c.resolved_head_dim, model.device, model.dtype)
            for _ in range(c.n_layers)
        ]
        return CachedSession(model, caches, max_len)

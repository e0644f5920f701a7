"""The contiguous decode-attention kernel (`cpu_decode_attention.c`), the read `contiguous`, `dynamic`
and `static_full` use on a CPU in fp32: the operator `torch.ops.harness_kernels.decode_attention` of
the kernels' extension (harness.kernels.extension), built on first use for this CPU; where it cannot be
built, `unavailable` says why.
"""
from __future__ import annotations

import torch

from harness.kernels.extension import Kernel, ops

CONTIGUOUS_KERNEL = Kernel("cpu_decode_attention.c")
KERNEL_NAME = CONTIGUOUS_KERNEL.name


def unavailable(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why the contiguous kernel cannot run for this device and dtype, or None when it can."""
    return CONTIGUOUS_KERNEL.unavailable(device, dtype)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, length: int,
                     visible: int | None = None) -> torch.Tensor:
    """q [B, n_kv, G, D]; k, v [B, n_kv, S, D] cache tables (rows 0..length-1 are read) -> [B, n_kv, G, D].

    Softmax(q k^T / sqrt(D)) v for one query position per sequence; the backend rule
    (strategies.backends) has checked the device, dtype and shape. Rows visible.. are still read and multiplied, by an exact 0
    (None: none): what attention over a whole preallocated table under a mask costs, as `static_full`
    measures. Eager and under torch.compile alike this is one call of the operator, which a compiled
    graph keeps as one opaque kernel.
    """
    return ops().decode_attention(q, k, v, length, length if visible is None else visible)


def attend_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, length: int,
                 visible: int | None = None) -> torch.Tensor:
    """The kernel on a layer's own layout: q [B, 1, H, D] (query head h = kv * G + g, as in
    strategies.caches.attention.grouped_attention) -> [B, 1, H, D]; rows visible.. weighted 0 (None: none)."""
    batch, _, n_heads, head_dim = q.shape
    n_kv = k.shape[1]
    grouped = q.reshape(batch, n_kv, n_heads // n_kv, head_dim)  # [B, n_kv, G, D]
    return decode_attention(grouped, k, v, length, visible).view(batch, 1, n_heads, head_dim)


"""The contiguous decode-attention kernel (`cpu_decode_attention.c`), the read `contiguous`, `dynamic`
and `static_full` use on a CPU in fp32, and the kernels' shared limits.

Built and loaded through harness.kernels.build (`CKernel`): compiled on first use for this CPU; where it
cannot be built, `unavailable` says why.
"""
from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from harness.kernels.build import POINTER, SIZE, STRIDES, CKernel


MAX_GROUP, MAX_DIM = 32, 512  # the contiguous kernel's limits (MAX_GROUP, MAX_DIM in its C source)
CONTIGUOUS_KERNEL = CKernel(Path(__file__).with_name("cpu_decode_attention.c"), {
    # q, k, k_strides, v, v_strides, out, batch, n_kv, group, length, visible, dim, scale, threads
    "decode_attention": [POINTER, POINTER, STRIDES, POINTER, STRIDES, POINTER, SIZE, SIZE, SIZE, SIZE, SIZE, SIZE,
                         ctypes.c_float, ctypes.c_int],
})
KERNEL_NAME = CONTIGUOUS_KERNEL.name
SOURCE = CONTIGUOUS_KERNEL.source


def unavailable(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why the contiguous kernel cannot run for this device and dtype, or None when it can."""
    return CONTIGUOUS_KERNEL.unavailable(device, dtype)


def shape_unsupported(group: int, head_dim: int) -> str | None:
    """Why the kernel cannot take `group` query heads per KV head of width `head_dim`, or None."""
    if group > MAX_GROUP or head_dim > MAX_DIM:
        return (f"{SOURCE.name} takes at most {MAX_GROUP} query heads per KV head and head_dim {MAX_DIM}; "
                f"this model has {group} and {head_dim}")
    return None


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, length: int) -> torch.Tensor:
    """q [B, n_kv, G, D]; k, v [B, n_kv, S, D] cache tables (rows 0..length-1 are read) -> [B, n_kv, G, D].

    Softmax(q k^T / sqrt(D)) v for one query position per sequence; the caller has checked
    `unavailable` and `shape_unsupported`. Eager calls go straight to the library; under torch.compile
    the call is the custom op `harness::decode_attention`, which the graph keeps as one opaque kernel
    (dynamo cannot trace a ctypes call, and a graph break would run the step eager in pieces).
    """
    return masked_decode_attention(q, k, v, length, visible=length)


def attend_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, length: int,
                 visible: int | None = None) -> torch.Tensor:
    """The kernel on a layer's own layout: q [B, 1, H, D] (query head h = kv * G + g, as in
    strategies.attention.grouped_attention) -> [B, 1, H, D]; rows visible.. weighted 0 (None: none)."""
    batch, _, n_heads, head_dim = q.shape
    n_kv = k.shape[1]
    grouped = q.reshape(batch, n_kv, n_heads // n_kv, head_dim)  # [B, n_kv, G, D]
    out = masked_decode_attention(grouped, k, v, length, visible=length if visible is None else visible)
    return out.view(batch, 1, n_heads, head_dim)


def masked_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, length: int,
                            visible: int) -> torch.Tensor:
    """`decode_attention` reading rows 0..length-1 of k and v, of which rows visible.. get weight 0.

    The masked rows are still read and multiplied (by an exact 0): what attention over a whole
    preallocated table under a mask costs, as `static_full` measures.
    """
    if torch.compiler.is_compiling():
        return torch.ops.harness.decode_attention(q, k, v, length, visible)
    return _decode_attention(q, k, v, length, visible)


def _decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, length: int, visible: int) -> torch.Tensor:
    library = CONTIGUOUS_KERNEL.library()
    batch, n_kv, group, head_dim = q.shape
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("cache rows must be contiguous")
    q = q.contiguous()
    out = torch.empty_like(q)  # [B, n_kv, G, D]
    strides = ctypes.c_int64 * 3
    library.decode_attention(
        q.data_ptr(), k.data_ptr(), strides(*k.stride()[:3]), v.data_ptr(), strides(*v.stride()[:3]), out.data_ptr(),
        batch, n_kv, group, length, visible, head_dim, head_dim**-0.5, torch.get_num_threads(),
    )
    return out


# The op torch.compile sees (registered through torch.library.Library: a dispatch per call, not
# custom_op's Python wrapper). It reads k and v and writes only its output.
_LIBRARY = torch.library.Library("harness", "FRAGMENT")
_LIBRARY.define("decode_attention(Tensor q, Tensor k, Tensor v, SymInt length, SymInt visible) -> Tensor")
_LIBRARY.impl("decode_attention", _decode_attention, "CompositeExplicitAutograd")


@torch.library.register_fake("harness::decode_attention")
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, length: int, visible: int) -> torch.Tensor:
    return torch.empty(q.shape, dtype=q.dtype, device=q.device)  # [B, n_kv, G, D], contiguous

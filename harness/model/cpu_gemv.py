"""The C small-batch linear (`cpu_gemv.c`): the CPU fp32 matmul of `matmul=c`, what `auto` picks there;
and the small operators between the linears (RMSNorm, RoPE, SwiGLU's activation) through the same library.

A decode step's linears multiply a handful of rows (the batch) by whole weight matrices, so their
time is the weight read. The C kernel reads each thread's weight rows as STREAMS interleaved streams
(why: its header). On the 2-core Xeon VM it took the 33 linears of a cpu_small step from 11.4 ms
(aten) and 13.2 ms (oneDNN packed) to 7.9 ms at 1 row, and from 16.3 ms (oneDNN) to 9.9 ms at 4
(docs/performance.md). Above MAX_ROWS rows (prefill, no_cache's re-run of the sequence, large batches)
a call goes to aten's `F.linear`, whose blocked GEMM is built for them; rows name both
(`matmul_kernel`). The weight stays the dense nn.Linear weight: no second copy.

The small operators go with it: between two weight reads each torch operator ran cold, a few hundred
microseconds where it takes a few warm (docs/performance.md, "small operators that run cold"). One C
call per RMSNorm (`F.rms_norm` is a composite of seven operators on a CPU) took 0.7-1.0 ms off a
cpu_small step; RoPE and SwiGLU's activation are one call each too. Calls of more rows, and compiled
graphs (which inductor fuses itself), stay torch's.
"""
from __future__ import annotations

import ctypes
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from harness.kernels.build import POINTER, SIZE, CKernel
from harness.model.decoder import RMSNorm, RotaryTable, SwiGLU
from harness.model.swap import swap_modules

# Rows up to which the C kernel runs (measured at cpu_small: at 16 rows it matched oneDNN packed, 23.6
# against 23.0 ms for the step's linears; at 8 it took 11.0 against 16.2 ms).
MAX_ROWS = 16
GEMV_KERNEL = CKernel(Path(__file__).with_name("cpu_gemv.c"), {
    # x, w, out, n_inputs, k_len, n_len, threads
    "gemv": [POINTER, POINTER, POINTER, SIZE, SIZE, SIZE, ctypes.c_int],
    # x, weight, eps, out, n_inputs, k_len
    "rms_norm_rows": [POINTER, POINTER, ctypes.c_float, POINTER, SIZE, SIZE],
    # x, batch_stride, token_stride, head_stride, cos, sin, out, batch, tokens, heads, dim
    "rope_rows": [POINTER, SIZE, SIZE, SIZE, POINTER, POINTER, POINTER, SIZE, SIZE, SIZE, SIZE],
    # gate_up, out, rows, ffn
    "silu_mul_rows": [POINTER, POINTER, SIZE, SIZE],
})
KERNEL_NAME = f"{GEMV_KERNEL.name} up to {MAX_ROWS} rows (linears, RMSNorm, RoPE, SwiGLU), aten above"  # rows name it


def unavailable() -> str | None:
    """Why the C linear cannot run here (no compiler, a failed build), or None when it can."""
    return GEMV_KERNEL.unavailable(torch.device("cpu"), torch.float32)


class GemvLinear(nn.Module):
    """A bias-free fp32 CPU linear: calls of up to MAX_ROWS rows run the C kernel, larger ones aten's."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight  # [out, in], the same tensor: nothing is copied

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [..., in] -> [..., out]
        if x.numel() > MAX_ROWS * self.in_features:
            return F.linear(x, self.weight)
        if torch.compiler.is_compiling():  # dynamo cannot trace a ctypes call: an opaque op of the graph
            return torch.ops.harness.gemv(x, self.weight)
        return gemv(x, self.weight)


def gemv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., in] @ weight [out, in]^T through the C kernel, any row count (GemvLinear keeps it to few)."""
    rows = x.contiguous()  # [..., in]
    out = rows.new_empty((*x.shape[:-1], weight.shape[0]))  # [..., out]
    GEMV_KERNEL.library().gemv(rows.data_ptr(), weight.data_ptr(), out.data_ptr(), rows.numel() // weight.shape[1],
                               weight.shape[1], weight.shape[0], torch.get_num_threads())
    return out


# `harness::gemv`: the kernel as an op of a torch.compile graph, registered through
# torch.library.Library like harness::packed_linear (a dispatch per call, not custom_op's wrapper).
_LIBRARY = torch.library.Library("harness", "FRAGMENT")
_LIBRARY.define("gemv(Tensor x, Tensor weight) -> Tensor")
_LIBRARY.impl("gemv", gemv, "CompositeExplicitAutograd")


@torch.library.register_fake("harness::gemv")
def _(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))  # [..., out]


class GemvRMSNorm(nn.Module):
    """The model's RMSNorm (harness.model.decoder.RMSNorm, same weight and eps): calls of up to MAX_ROWS
    rows through the C library, larger ones and compiled graphs through F.rms_norm."""

    def __init__(self, norm: nn.Module):
        super().__init__()
        self.eps = norm.eps
        self.weight = norm.weight  # [dim], the same tensor

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [..., dim] -> [..., dim]
        if not few_rows(x, self.weight.numel()):
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)  # inductor fuses it itself
        rows = x.contiguous()
        out = torch.empty_like(rows)
        GEMV_KERNEL.library().rms_norm_rows(rows.data_ptr(), self.weight.data_ptr(), self.eps, out.data_ptr(),
                                            rows.numel() // rows.shape[-1], rows.shape[-1])
        return out


def few_rows(x: torch.Tensor, width: int) -> bool:
    """Whether x [..., width] is a call the C kernels take: at most MAX_ROWS rows, eager."""
    return x.numel() <= MAX_ROWS * width and not torch.compiler.is_compiling()


class GemvRotaryTable(RotaryTable):
    """The model's RoPE tables; a rotation of few rows is one C call, read through the input's strides."""

    def rotate(self, x: torch.Tensor, start_pos: int) -> torch.Tensor:  # x [B, T, heads, D] -> same, contiguous
        batch, seq_len, heads, head_dim = x.shape
        if not few_rows(x, heads * head_dim) or x.stride(-1) != 1:
            return super().rotate(x, start_pos)
        out = x.new_empty(x.shape)
        GEMV_KERNEL.library().rope_rows(
            x.data_ptr(), x.stride(0), x.stride(1), x.stride(2), self.cos[start_pos].data_ptr(),
            self.sin[start_pos].data_ptr(), out.data_ptr(), batch, seq_len, heads, head_dim)
        return out


class GemvSwiGLU(nn.Module):
    """The model's SwiGLU (its w13 and w2, GemvLinears by now): silu(gate) * up of few rows in one C call."""

    def __init__(self, swiglu: nn.Module):
        super().__init__()
        self.w13, self.w2 = swiglu.w13, swiglu.w2

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [..., d_model] -> [..., d_model]
        gate_up = self.w13(x)  # [..., 2 * ffn]: gate, then up
        ffn = gate_up.shape[-1] // 2
        if not few_rows(gate_up, 2 * ffn):
            gate, up = gate_up.chunk(2, dim=-1)
            return self.w2(F.silu(gate).mul_(up))
        hidden = gate_up.new_empty((*gate_up.shape[:-1], ffn))  # [..., ffn]
        GEMV_KERNEL.library().silu_mul_rows(gate_up.data_ptr(), hidden.data_ptr(), gate_up.numel() // (2 * ffn), ffn)
        return self.w2(hidden)


def use_gemv(model: nn.Module) -> int:
    """Replace every nn.Linear of `model` by a GemvLinear, every RMSNorm by a GemvRMSNorm and every
    SwiGLU by a GemvSwiGLU, over the same weights, and its RoPE by GemvRotaryTable; returns how many
    linears."""
    model.rotary = GemvRotaryTable
    linears = swap_modules(model, nn.Linear, GemvLinear)
    swap_modules(model, RMSNorm, GemvRMSNorm)
    swap_modules(model, SwiGLU, GemvSwiGLU)  # after the linears: it keeps the GemvLinears it finds
    return linears

"""The C small-batch linear (`cpu_gemv.c`): the CPU fp32 matmul of `matmul=c`, what `auto` picks there;
and the RMSNorms before the linears through the same library.

A decode step's linears multiply a handful of rows (the batch) by whole weight matrices, so their
time is the weight read. The C kernel reads each thread's weight rows as STREAMS interleaved streams
(why: its header). On the 2-core Xeon VM it took the 33 linears of a cpu_small step from 11.4 ms
(aten) and 13.2 ms (oneDNN packed) to 7.9 ms at 1 row, and from 16.3 ms (oneDNN) to 9.9 ms at 4
(docs/performance.md). Above MAX_ROWS rows (prefill, no_cache's re-run of the sequence, large batches)
a call goes to aten's `F.linear`, whose blocked GEMM is built for them; rows name both
(`matmul_kernel`). The weight stays the dense nn.Linear weight: no second copy.

The RMSNorms go with it: through torch (`F.rms_norm`, a composite of seven operators on a CPU) a norm
between two weight reads ran cold, each a few hundred microseconds, and one C call took 0.7-1.0 ms off
a cpu_small step (docs/performance.md, "small operators that run cold").
"""
from __future__ import annotations

import ctypes
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from harness.kernels.build import POINTER, SIZE, CKernel

# Rows up to which the C kernel runs (measured at cpu_small: at 16 rows it matched oneDNN packed, 23.6
# against 23.0 ms for the step's linears; at 8 it took 11.0 against 16.2 ms).
MAX_ROWS = 16
GEMV_KERNEL = CKernel(Path(__file__).with_name("cpu_gemv.c"), {
    # x, w, out, n_inputs, k_len, n_len, threads
    "gemv": [POINTER, POINTER, POINTER, SIZE, SIZE, SIZE, ctypes.c_int],
    # x, weight, eps, out, n_inputs, k_len
    "rms_norm_rows": [POINTER, POINTER, ctypes.c_float, POINTER, SIZE, SIZE],
})
KERNEL_NAME = f"{GEMV_KERNEL.name} up to {MAX_ROWS} rows (linears, RMSNorm), aten above"  # how rows name it


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
        if x.numel() > MAX_ROWS * self.weight.numel() or torch.compiler.is_compiling():
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)  # inductor fuses it itself
        rows = x.contiguous()
        out = torch.empty_like(rows)
        GEMV_KERNEL.library().rms_norm_rows(rows.data_ptr(), self.weight.data_ptr(), self.eps, out.data_ptr(),
                                            rows.numel() // rows.shape[-1], rows.shape[-1])
        return out


def use_gemv(model: nn.Module) -> int:
    """Replace every nn.Linear of `model` by a GemvLinear and every RMSNorm by a GemvRMSNorm, over the
    same weights; returns how many linears."""
    from harness.model.decoder import RMSNorm

    replace = {nn.Linear: GemvLinear, RMSNorm: GemvRMSNorm}
    found = [(name, replace[type(module)]) for name, module in model.named_modules() if type(module) in replace]
    for name, kernel in found:
        parent_name, _, attribute = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attribute, kernel(getattr(parent, attribute)))
    return sum(kernel is GemvLinear for _, kernel in found)

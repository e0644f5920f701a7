"""oneDNN-packed linear layers: the CPU matmul path for batches the C small-batch linear does not take.

A decode step is a handful of skinny matmuls (batch rows against a whole weight matrix). aten's
`F.linear` (MKL) reads such a weight well at one row but falls behind at a few rows and at larger
batches, while oneDNN with the weight reordered once into its blocked layout (what torch.compile's
CPU freezing does) keeps up across batch sizes (scripts/linear_read_rate.py measures both on the
machine at hand). The reorder happens once per point, before timing; the math is the same
matmul, so outputs agree to rounding and every strategy's tokens still equal the reference's
(tests/test_exactness.py).

`matmul=auto` picks the C small-batch linear (harness.model.cpu_gemv) on a CPU in fp32 where it
builds, since it read the small matrices of a decode step faster than oneDNN where both were
measured; else oneDNN where that supports the dtype (its bf16 path needs AVX-512 or AVX-NE-CONVERT),
aten otherwise; rows record which kernel ran in `matmul_kernel`.
"""
from __future__ import annotations

import functools

import torch
from torch import nn

from harness.model import cpu_gemv
from harness.model.swap import swap_modules

KERNELS = {"aten": "aten.linear", "onednn": "onednn.linear(packed weight)", "c": cpu_gemv.KERNEL_NAME}


@functools.cache
def onednn_supports(dtype_name: str) -> bool:
    """Whether this CPU and torch build can pack and run a linear in `dtype_name`."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        weight = torch.ones(2, 2, dtype=getattr(torch, dtype_name))
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, 1)
        torch.ops.mkldnn._linear_pointwise(torch.ones(1, 2, dtype=weight.dtype), packed, None, "none", [], "")
    except (RuntimeError, AttributeError):
        return False
    return True


def resolve_matmul(matmul: str, device: str, dtype: str, batch: int) -> str:
    """`auto`: on a CPU the C kernel in fp32 where it builds and a decode step's `batch` rows are few
    enough for it (MAX_ROWS), else oneDNN-packed where it supports the dtype; aten otherwise."""
    if matmul != "auto":
        return matmul
    if device == "cpu" and dtype == "float32" and batch <= cpu_gemv.MAX_ROWS and cpu_gemv.unavailable() is None:
        return "c"
    return "onednn" if device == "cpu" and onednn_supports(dtype) else "aten"


class PackedLinear(nn.Module):
    """A bias-free linear whose weight lives in oneDNN's blocked layout (no dense copy is kept)."""

    def __init__(self, linear: nn.Linear, batch_hint: int):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # batch_hint: the row count the layout is tuned for (the decode batch).
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), batch_hint)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [..., in] -> [..., out]
        if torch.compiler.is_compiling():  # inductor cannot lower a weight it did not pack itself
            return torch.ops.harness.packed_linear(x, self.packed_weight, self.out_features)
        return _packed_linear(x, self.packed_weight, self.out_features)


def _packed_linear(x: torch.Tensor, packed_weight: torch.Tensor, out_features: int) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed_weight, None, "none", [], "")


# `harness::packed_linear`: the same oneDNN call as an opaque kernel of a torch.compile graph. Registered
# through torch.library.Library rather than custom_op: its calls cost a dispatch, not custom_op's
# Python wrapper, which costs several times as much and is paid for every linear of a step.
_LIBRARY = torch.library.Library("harness", "FRAGMENT")
_LIBRARY.define("packed_linear(Tensor x, Tensor packed_weight, int out_features) -> Tensor")
_LIBRARY.impl("packed_linear", _packed_linear, "CompositeExplicitAutograd")


@torch.library.register_fake("harness::packed_linear")
def _(x: torch.Tensor, packed_weight: torch.Tensor, out_features: int) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], out_features))  # [..., out]


def pack_linears(model: nn.Module, batch_hint: int) -> int:
    """Replace every nn.Linear of `model` by a PackedLinear, one at a time (peak: one extra weight)."""
    return swap_modules(model, nn.Linear, lambda linear: PackedLinear(linear, batch_hint))

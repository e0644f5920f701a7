"""oneDNN-packed linear layers: the CPU matmul path for batches the C small-batch linear does not take.

A decode step is a handful of skinny matmuls (batch rows against a whole weight matrix). aten's
`F.linear` (MKL) reads such a weight well at one row but falls behind at a few rows and at larger
batches, while oneDNN with the weight reordered once into its blocked layout (what torch.compile's
CPU freezing does) keeps up across batch sizes (scripts/linear_read_rate.py measures both on the
machine at hand). The reorder happens once per point, before timing; the math is the same
matmul, so outputs agree to rounding and every strategy's tokens still equal the reference's
(tests/test_exactness.py).

The linear kernels are data, like a strategy's attention backends (strategies/backends.py):
LINEAR_KERNELS lists each with what it needs (devices, dtypes, the rows it takes, a bias, a build),
in preference order, and `choose_linear` is the one rule, used by the runner's plan
(harness.run.resolve), the calibration and the in-round read probe (harness.measure.roofs):
`matmul=auto` takes the first kernel whose needs hold: the C small-batch linear
(harness.model.cpu_gemv) on a CPU in fp32 where it builds and the batch is small, since it read the
small matrices of a decode step faster than oneDNN where both were measured; else oneDNN where that
supports the dtype (its bf16 path needs AVX-512 or AVX-NE-CONVERT); aten otherwise. A kernel named
by `matmul` is taken where its needs hold, else refused with the reason. Rows record which kernel
ran in `matmul_kernel`.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Optional

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


@dataclass(frozen=True)
class LinearKernel:
    """One kernel the model's linear layers can run, and what it needs."""

    name: str  # the value of `matmul` that asks for it, and the point's matmul where it runs
    probe: str  # its name in the calibration's and the rounds' read probes (harness.measure.roofs)
    devices: Optional[tuple[str, ...]] = None  # device types it runs on; None: every one
    dtypes: Optional[tuple[str, ...]] = None  # dtypes it runs in; None: every one (else see `condition`)
    max_rows: Optional[int] = None  # `auto` takes it only for a batch of at most this many rows
    adds_bias: bool = True  # False: it drops a linear's bias (a model with biased q/k/v cannot use it)
    condition: Optional[Callable[[str], Optional[str]]] = None  # other needs: dtype name -> why not, or None

    def unmet(self, device: str, dtype: str) -> str | None:
        """Why it cannot run on this device type and dtype here, or None."""
        if self.devices is not None and device not in self.devices:
            return f"{self.name} is a {'/'.join(self.devices).upper()} kernel; this point runs on {device}"
        if self.dtypes is not None and dtype not in self.dtypes:
            return f"{self.name} runs in {', '.join(self.dtypes)}; this point is {dtype}"
        return self.condition(dtype) if self.condition is not None else None


def _onednn_unmet(dtype: str) -> str | None:
    return None if onednn_supports(dtype) else f"oneDNN packing is not supported for {dtype} here"


def _c_unmet(dtype: str) -> str | None:
    reason = cpu_gemv.unavailable()
    return f"the C linear cannot run here ({reason})" if reason else None


# In `auto`'s order of preference; aten runs everywhere and is the last resort.
LINEAR_KERNELS = (
    LinearKernel("c", "c", devices=("cpu",), dtypes=("float32",), max_rows=cpu_gemv.MAX_ROWS, adds_bias=False,
                 condition=_c_unmet),
    LinearKernel("onednn", "packed", devices=("cpu",), adds_bias=False, condition=_onednn_unmet),
    LinearKernel("aten", "aten"),
)


class LinearUnavailable(Exception):
    """The named linear kernel cannot run this point; the message is the reason."""


def choose_linear(matmul: str, device: str, dtype: str, batch: int | None = None, bias: bool = False) -> LinearKernel:
    """The linear kernel a point runs: for `auto` the first of LINEAR_KERNELS whose needs hold (the
    batch within its rows; a bias kept where the model has one); a named one where its needs hold,
    else LinearUnavailable with the reason."""
    for kernel in LINEAR_KERNELS:
        if matmul not in ("auto", kernel.name):
            continue
        reason = kernel.unmet(device, dtype)
        if reason is None and bias and not kernel.adds_bias:
            reason = f"{kernel.name} drops a bias, and this model's q/k/v projections have one (model.attention_bias)"
        if matmul != "auto" and reason is not None:
            raise LinearUnavailable(reason)
        if reason is None and (matmul != "auto" or kernel.max_rows is None or batch is None or batch <= kernel.max_rows):
            return kernel
    raise LinearUnavailable(f"no linear kernel is named {matmul!r}; allowed: auto, "
                            f"{', '.join(kernel.name for kernel in LINEAR_KERNELS)}")


def runnable_linears(device: str, dtype: str, leave_out: tuple[str, ...] = ()) -> tuple[LinearKernel, ...]:
    """Every linear kernel whose needs hold on this device type and dtype, aten first; those named in
    `leave_out` are not even asked (asking the C linear builds it)."""
    return tuple(kernel for kernel in reversed(LINEAR_KERNELS)
                 if kernel.name not in leave_out and kernel.unmet(device, dtype) is None)


def resolve_matmul(matmul: str, device: str, dtype: str, batch: int) -> str:
    """The kernel's name `choose_linear` gives (`auto` resolved)."""
    return choose_linear(matmul, device, dtype, batch).name


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

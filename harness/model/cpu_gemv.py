"""The C small-batch linear (`cpu_gemv.c`): the CPU fp32 matmul of `matmul=c`, what `auto` picks there;
and a decode step's decoder blocks through the same kernel file, two calls a block. Each is an
operator of the kernels' extension (harness.kernels.extension), `torch.ops.harness_kernels.*`, which
eager code and compiled graphs call alike.

A decode step's linears multiply a handful of rows (the batch) by whole weight matrices, so their
time is the weight read. The C kernel reads each thread's weight rows as STREAMS interleaved streams
(why: its source), which reads a small model's matrices faster than aten's and oneDNN's kernels did
where it was measured (scripts/step_kernels_ab.py measures them again). Above MAX_ROWS rows (prefill, no_cache's re-run of the
sequence, large batches) a call goes to aten's `F.linear`, whose blocked GEMM is built for them;
rows name both (`matmul_kernel`). The weight stays the dense nn.Linear weight: no second copy.

The operators between the linears go with them. Between two weight reads each torch operator runs
cold, and each call from Python costs more than a warm small operator takes. So
a block of few rows is two calls (GemvBlock): the RMSNorm, the qkv projection and RoPE; then, after
the strategy's cache has attended, the output projection and its residual add, the second RMSNorm,
SwiGLU and its residual add. Calls of more rows run the block's own modules.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from harness.kernels.extension import Kernel, ops
from harness.model.decoder import Block, RMSNorm, RotaryTable, SequencePositions
from harness.model.swap import swap_modules

# Rows up to which the C kernel runs: where it met oneDNN's packed linear on the CPU it was tuned on
# (scripts/step_kernels_ab.py measures both on the machine at hand).
MAX_ROWS = 16
GEMV_KERNEL = Kernel("cpu_gemv.c")
KERNEL_NAME = f"{GEMV_KERNEL.name} up to {MAX_ROWS} rows (decoder blocks in two calls, linears), aten above"  # rows name it


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
        return gemv(x, self.weight)


def gemv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., in] @ weight [out, in]^T through the C kernel, any row count (GemvLinear keeps it to few)."""
    return ops().gemv(x, weight)


class GemvRMSNorm(nn.Module):
    """The model's RMSNorm (harness.model.decoder.RMSNorm, same weight and eps): calls of up to MAX_ROWS
    rows through the C kernel, larger ones and compiled graphs through F.rms_norm."""

    def __init__(self, norm: nn.Module):
        super().__init__()
        self.eps = norm.eps
        self.weight = norm.weight  # [dim], the same tensor

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [..., dim] -> [..., dim]
        if not few_rows(x, self.weight.numel()):
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)  # inductor fuses it itself
        return ops().rms_norm(x, self.weight, self.eps)


def few_rows(x: torch.Tensor, width: int) -> bool:
    """Whether x [..., width] is a call the C kernels take: at most MAX_ROWS rows, eager."""
    return x.numel() <= MAX_ROWS * width and not torch.compiler.is_compiling()


class GemvBlock(nn.Module):
    """A decoder block (harness.model.decoder.Block, its modules and weights) whose few-row calls are two
    C calls around the strategy's cache: what Block.forward computes, in the same order and in fp32.

        qkv = rope(rms_norm(x) @ wqkv^T)                            attention_input
        out = cache.attend(q, k, v)                                 the strategy, unchanged
        x += out @ wo^T;  x += swiglu(rms_norm(x))                  attention_output_and_ffn_

    Both are operators (harness_kernels::attention_input, harness_kernels::attention_output_and_ffn_):
    eager and compiled steps make the same two calls, and a compiled graph keeps them as its ops. Their
    scratch rows (the normed rows, SwiGLU's gate/up and hidden rows) live in the extension; the q/k/v
    tensor handed to the cache is new each call, since a cache may keep what it is given.
    """

    def __init__(self, block: Block):
        super().__init__()
        self.block = block  # its modules: the weights, and the call for many rows
        attention, norm, ffn_norm, feed_forward = block.attention, block.attention_norm, block.ffn_norm, block.feed_forward
        self.heads = (attention.n_heads, attention.n_kv_heads)
        # The calls' weights in plain tuples: a step reads them without nn.Module's __getattr__.
        self.attention_weights = (norm.weight, norm.eps, attention.wqkv.weight)
        self.output_and_ffn_weights = (attention.wo.weight, ffn_norm.weight, ffn_norm.eps, feed_forward.w13.weight,
                                       feed_forward.w2.weight)

    def forward(self, x: torch.Tensor, rope: RotaryTable, cache, start_pos: int) -> torch.Tensor:
        d_model = x.shape[-1]  # x: [B, T, d_model], the residual stream, updated in place
        if x.numel() > MAX_ROWS * d_model or not x.is_contiguous():
            return self.block(x, rope, cache, start_pos)
        n_heads, n_kv_heads = self.heads
        kernels = ops()
        if isinstance(start_pos, SequencePositions):
            # Each sequence at its own position: the kernel ropes token t with row t of the tables it is
            # given, so the batch goes in as the tokens of one row, with each sequence's own rows.
            batch, tokens = x.shape[:2]
            qkv = kernels.attention_input(x.view(1, batch * tokens, d_model), *self.attention_weights, start_pos.cos,
                                          start_pos.sin, 0, n_heads, n_kv_heads).view(batch, tokens, n_heads + 2 * n_kv_heads, -1)
        else:
            qkv = kernels.attention_input(x, *self.attention_weights, rope.cos, rope.sin, start_pos, n_heads, n_kv_heads)
        q, k, v = qkv.split((n_heads, n_kv_heads, n_kv_heads), dim=2)  # [B, T, heads, D] each
        out = cache.attend(q, k, v, start_pos).contiguous()  # [B, T, H, D]
        kernels.attention_output_and_ffn_(x, out, *self.output_and_ffn_weights)
        return x


def use_gemv(model: nn.Module) -> int:
    """Replace every nn.Linear of `model` by a GemvLinear and every RMSNorm by a GemvRMSNorm, over the
    same weights, then wrap every decoder Block in a GemvBlock; returns how many linears. The kernels'
    extension is loaded (built if need be) here, in the process that will call it: a point whose only C
    calls are the model's (no strategy kernel loaded it) must find its operators registered."""
    reason = unavailable()
    if reason is not None:
        raise RuntimeError(f"matmul=c cannot run here: {reason}")
    linears = swap_modules(model, nn.Linear, GemvLinear)
    swap_modules(model, RMSNorm, GemvRMSNorm)
    swap_modules(model, Block, GemvBlock)  # after the others: the block's own modules are the C path's too
    return linears

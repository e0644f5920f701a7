"""The C small-batch linear (`cpu_gemv.c`): the CPU fp32 matmul of `matmul=c`, what `auto` picks there;
and a decode step's decoder blocks through the same library, two calls a block.

A decode step's linears multiply a handful of rows (the batch) by whole weight matrices, so their
time is the weight read. The C kernel reads each thread's weight rows as STREAMS interleaved streams
(why: its header). On the 2-core Xeon VM it took the 33 linears of a cpu_small step from 11.4 ms
(aten) and 13.2 ms (oneDNN packed) to 7.9 ms at 1 row, and from 16.3 ms (oneDNN) to 9.9 ms at 4
(docs/performance.md). Above MAX_ROWS rows (prefill, no_cache's re-run of the sequence, large batches)
a call goes to aten's `F.linear`, whose blocked GEMM is built for them; rows name both
(`matmul_kernel`). The weight stays the dense nn.Linear weight: no second copy.

The operators between the linears go with them. Between two weight reads each torch operator ran
cold, a few hundred microseconds where it takes a few warm, and each call from Python cost 7-15 us
before it read a byte (docs/performance.md, "small operators that run cold"). So a block of few rows
is two C calls (GemvBlock): the RMSNorm, the qkv projection and RoPE; then, after the strategy's
cache has attended, the output projection and its residual add, the second RMSNorm, SwiGLU and its
residual add. Under torch.compile the two calls are ops of the graph; calls of more rows run the
block's own modules.
"""
from __future__ import annotations

import ctypes
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from harness.kernels.build import POINTER, SIZE, CKernel
from harness.model.decoder import Block, RMSNorm, RotaryTable
from harness.model.swap import swap_modules

# Rows up to which the C kernel runs (measured at cpu_small: at 16 rows it matched oneDNN packed, 23.6
# against 23.0 ms for the step's linears; at 8 it took 11.0 against 16.2 ms).
MAX_ROWS = 16
GEMV_KERNEL = CKernel(Path(__file__).with_name("cpu_gemv.c"), {
    # x, w, out, n_inputs, k_len, n_len, threads
    "gemv": [POINTER, POINTER, POINTER, SIZE, SIZE, SIZE, ctypes.c_int],
    # x, weight, eps, out, n_inputs, k_len
    "rms_norm_rows": [POINTER, POINTER, ctypes.c_float, POINTER, SIZE, SIZE],
    # x, norm_weight, eps, wqkv, cos, sin, normed, qkv, batch, tokens, d_model, heads, rotated_heads, dim, threads
    "attention_input": [POINTER, POINTER, ctypes.c_float, POINTER, POINTER, POINTER, POINTER, POINTER, SIZE, SIZE, SIZE,
                        SIZE, SIZE, SIZE, ctypes.c_int],
    # attention, wo, x, norm_weight, eps, w13, w2, normed, gate_up, hidden, rows, d_model, attention_width, ffn, threads
    "attention_output_and_ffn": [POINTER, POINTER, POINTER, POINTER, ctypes.c_float, POINTER, POINTER, POINTER, POINTER,
                                 POINTER, SIZE, SIZE, SIZE, SIZE, ctypes.c_int],
})
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


def attention_input(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, wqkv: torch.Tensor, cos: torch.Tensor,
                    sin: torch.Tensor, start_pos: int, n_heads: int, n_kv_heads: int,
                    normed: torch.Tensor | None = None) -> torch.Tensor:
    """rope(rms_norm(x) @ wqkv^T) in one C call: x [B, T, d_model] contiguous at positions start_pos..,
    cos/sin the RoPE tables [max_len, D] -> qkv [B, T, H + 2 n_kv, D], queries and keys roped.
    `normed` [B * T, d_model] is scratch a caller may keep between calls."""
    batch, seq_len, d_model = x.shape
    head_dim = cos.shape[-1]
    normed = x.new_empty(batch * seq_len, d_model) if normed is None else normed
    qkv = x.new_empty(batch, seq_len, n_heads + 2 * n_kv_heads, head_dim)  # [B, T, H + 2 n_kv, D]
    table_offset = start_pos * head_dim * cos.element_size()  # bytes to the tables' row start_pos
    GEMV_KERNEL.library().attention_input(
        x.data_ptr(), norm_weight.data_ptr(), eps, wqkv.data_ptr(), cos.data_ptr() + table_offset,
        sin.data_ptr() + table_offset, normed.data_ptr(), qkv.data_ptr(), batch, seq_len, d_model,
        n_heads + 2 * n_kv_heads, n_heads + n_kv_heads, head_dim, torch.get_num_threads())
    return qkv


def attention_output_and_ffn_(x: torch.Tensor, attention: torch.Tensor, wo: torch.Tensor, norm_weight: torch.Tensor,
                              eps: float, w13: torch.Tensor, w2: torch.Tensor,
                              scratch: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> None:
    """x += attention @ wo^T, then x += swiglu(rms_norm(x)) in one C call, in place on x [B, T, d_model]
    (contiguous); attention [B, T, H, D] contiguous. `scratch`: normed [rows, d_model], gate_up
    [rows, 2 ffn], hidden [rows, ffn], which a caller may keep between calls."""
    rows, d_model = x.numel() // x.shape[-1], x.shape[-1]
    ffn = w2.shape[1]
    normed, gate_up, hidden = scratch or (x.new_empty(rows, d_model), x.new_empty(rows, 2 * ffn), x.new_empty(rows, ffn))
    GEMV_KERNEL.library().attention_output_and_ffn(
        attention.data_ptr(), wo.data_ptr(), x.data_ptr(), norm_weight.data_ptr(), eps, w13.data_ptr(), w2.data_ptr(),
        normed.data_ptr(), gate_up.data_ptr(), hidden.data_ptr(), rows, d_model, wo.shape[1], ffn,
        torch.get_num_threads())


# The two halves as ops of a torch.compile graph, like harness::gemv (inductor keeps them as calls).
_LIBRARY.define("attention_input(Tensor x, Tensor norm_weight, float eps, Tensor wqkv, Tensor cos, Tensor sin, "
                "SymInt start_pos, int n_heads, int n_kv_heads) -> Tensor")
_LIBRARY.impl("attention_input", attention_input, "CompositeExplicitAutograd")
_LIBRARY.define("attention_output_and_ffn_(Tensor(a!) x, Tensor attention, Tensor wo, Tensor norm_weight, float eps, "
                "Tensor w13, Tensor w2) -> ()")
_LIBRARY.impl("attention_output_and_ffn_", attention_output_and_ffn_, "CompositeExplicitAutograd")


@torch.library.register_fake("harness::attention_input")
def _(x, norm_weight, eps, wqkv, cos, sin, start_pos, n_heads, n_kv_heads) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], n_heads + 2 * n_kv_heads, cos.shape[-1]))  # [B, T, H + 2 n_kv, D]


@torch.library.register_fake("harness::attention_output_and_ffn_")
def _(x, attention, wo, norm_weight, eps, w13, w2) -> None:
    return None


class GemvBlock(nn.Module):
    """A decoder block (harness.model.decoder.Block, its modules and weights) whose few-row calls are two
    C calls around the strategy's cache: what Block.forward computes, in the same order and in fp32.

        qkv = rope(rms_norm(x) @ wqkv^T)                            attention_input
        out = cache.attend(q, k, v)                                 the strategy, unchanged
        x += out @ wo^T;  x += swiglu(rms_norm(x))                  attention_output_and_ffn_

    Under torch.compile the two calls are the graph's ops harness::attention_input and
    harness::attention_output_and_ffn_. Eager scratch (the normed rows, SwiGLU's gate/up and hidden
    rows) is kept per row count between steps; the q/k/v tensor handed to the cache is new each call,
    since a cache may keep what it is given.
    """

    def __init__(self, block: Block):
        super().__init__()
        self.block = block  # its modules: the weights, and the call for many rows
        attention, norm, ffn_norm, feed_forward = block.attention, block.attention_norm, block.ffn_norm, block.feed_forward
        self.heads = (attention.n_heads, attention.n_kv_heads)
        # The calls' weights in a tuple (plain attributes: a step reads them without nn.Module's __getattr__,
        # sixteen lookups a block measured ~12 us of its Python).
        self.attention_weights = (norm.weight, norm.eps, attention.wqkv.weight)
        self.output_and_ffn_weights = (attention.wo.weight, ffn_norm.weight, ffn_norm.eps, feed_forward.w13.weight,
                                       feed_forward.w2.weight)
        self._scratch: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def scratch(self, rows: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """normed [rows, d_model], gate_up [rows, 2 ffn], hidden [rows, ffn] for eager calls of `rows` rows."""
        if rows not in self._scratch:
            ffn = self.output_and_ffn_weights[-1].shape[1]
            self._scratch[rows] = (like.new_empty(rows, like.shape[-1]), like.new_empty(rows, 2 * ffn),
                                   like.new_empty(rows, ffn))
        return self._scratch[rows]

    def forward(self, x: torch.Tensor, rope: RotaryTable, cache, start_pos: int) -> torch.Tensor:
        batch, seq_len, d_model = x.shape  # x: [B, T, d_model], the residual stream, updated in place
        if x.numel() > MAX_ROWS * d_model or not x.is_contiguous():
            return self.block(x, rope, cache, start_pos)
        n_heads, n_kv_heads = self.heads
        compiling = torch.compiler.is_compiling()
        if compiling:
            qkv = torch.ops.harness.attention_input(x, *self.attention_weights, rope.cos, rope.sin, start_pos, *self.heads)
        else:
            scratch = self.scratch(batch * seq_len, x)
            qkv = attention_input(x, *self.attention_weights, rope.cos, rope.sin, start_pos, *self.heads, scratch[0])
        q, k, v = qkv.split((n_heads, n_kv_heads, n_kv_heads), dim=2)  # [B, T, heads, D] each
        out = cache.attend(q, k, v, start_pos).contiguous()  # [B, T, H, D]
        if compiling:
            torch.ops.harness.attention_output_and_ffn_(x, out, *self.output_and_ffn_weights)
        else:
            attention_output_and_ffn_(x, out, *self.output_and_ffn_weights, scratch)
        return x


def use_gemv(model: nn.Module) -> int:
    """Replace every nn.Linear of `model` by a GemvLinear and every RMSNorm by a GemvRMSNorm, over the
    same weights, then wrap every decoder Block in a GemvBlock; returns how many linears."""
    linears = swap_modules(model, nn.Linear, GemvLinear)
    swap_modules(model, RMSNorm, GemvRMSNorm)
    swap_modules(model, Block, GemvBlock)  # after the others: the block's own modules are the C path's too
    return linears

"""A Llama-3-style decoder: RMSNorm, RoPE, grouped-query attention, SwiGLU.

Its weights are seeded random ones or a checkpoint's (harness.model.factory). Llama 2/3/3.1, Mistral and
Qwen2 are this decoder with three options of the shape: a bias on the q/k/v projection (Qwen2), the
output head tied to the embedding table, and Llama 3.1's RoPE frequency scaling (`rope_scaling`).

The model knows nothing about caching. Each layer hands its roped queries and its new keys and values
to a per-layer cache object (`strategies.base.LayerCache.attend`), which decides what is stored and
what is read. That one call is the seam every decode strategy plugs into.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from harness.config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # One call instead of seven Python-dispatched ops (float, pow, mean, add, rsqrt, mul, type_as);
        # like Llama's, it takes the mean square in fp32 for bf16/fp16 inputs, and in fp32 its result is
        # bit for bit the composite's.
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


def rope_inverse_frequencies(head_dim: int, theta: float, scaling: Optional[ModelConfig] = None) -> torch.Tensor:
    """The rotation rate of each dimension pair [D/2], in float64: theta ** (-2i / D), and with
    `scaling.rope_scaling == "linear"` every rate divided by `factor`, with "llama3" Llama 3.1's stretch (transformers' _compute_llama3_parameters):
    wavelengths longer than original_max_len / low_freq_factor are slowed by `factor`, those shorter
    than original_max_len / high_freq_factor kept, and the ones between blended smoothly."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)  # [D/2]
    if scaling is None or scaling.rope_scaling is None:
        return inv_freq
    if scaling.rope_scaling == "linear":  # every position divided by `factor` (transformers' and llama.cpp's linear)
        return inv_freq / scaling.rope_scaling_factor
    factor, original = scaling.rope_scaling_factor, scaling.rope_original_max_len
    low, high = scaling.rope_low_freq_factor, scaling.rope_high_freq_factor
    wavelength = 2 * math.pi / inv_freq
    stretched = torch.where(wavelength > original / low, inv_freq / factor, inv_freq)
    smooth = (original / wavelength - low) / (high - low)
    blended = (1 - smooth) * stretched / factor + smooth * stretched
    medium = (wavelength >= original / high) & (wavelength <= original / low)
    return torch.where(medium, blended, stretched)


@dataclass(frozen=True)
class SequencePositions:
    """Every sequence of a batch at a position of its own (a serving pool's decode step: one token per
    sequence, harness.serve), and the RoPE rows of those positions, gathered once per forward pass
    (RotaryTable.at) for every layer. The decoder hands it on as `start_pos` to each layer's cache."""

    positions: torch.Tensor  # [B] int64: sequence b's new token sits at positions[b]
    cos: torch.Tensor  # [B, D] the rotary table's rows at those positions
    sin: torch.Tensor  # [B, D]


class RotaryTable:
    """RoPE for positions [0, max_len), tables built once per decode session.

    Rotate-half pairing (dimension i pairs with i + D/2), written as one product and one fused
    multiply-add per call: x * cos + swap_halves(x) * sin, with cos repeated over both halves and the
    sign of the pair's rotation folded into sin ([-sin, sin]). That is 3 ops where chunk, four
    multiplies, a subtraction, an addition and a cat were 8, and queries and keys are rotated together.
    """

    def __init__(self, head_dim: int, max_len: int, theta: float, device, dtype, scaling: Optional[ModelConfig] = None):
        inv_freq = rope_inverse_frequencies(head_dim, theta, scaling).to(device)  # [D/2]
        angles = torch.outer(torch.arange(max_len, device=device, dtype=torch.float64), inv_freq)  # [S, D/2]
        self.cos = angles.cos().repeat(1, 2).to(dtype)  # [max_len, D]: cos of pair i in columns i and i + D/2
        self.sin = torch.cat((-angles.sin(), angles.sin()), dim=-1).to(dtype)  # [max_len, D]

    def at(self, positions: torch.Tensor) -> SequencePositions:
        """Each sequence at its own position: positions [B] int64 -> their rows, for one forward pass."""
        return SequencePositions(positions, self.cos[positions], self.sin[positions])

    def rotate(self, x: torch.Tensor, start_pos: int | SequencePositions) -> torch.Tensor:
        """Rotate x [B, T, heads, D] whose tokens sit at positions start_pos .. start_pos + T - 1, or, with
        SequencePositions, x [B, 1, heads, D] whose sequence b's token sits at its own position."""
        batch, seq_len, heads, head_dim = x.shape
        if isinstance(start_pos, SequencePositions):
            cos, sin = start_pos.cos[:, None, None, :], start_pos.sin[:, None, None, :]  # [B, 1, 1, D]
        else:
            cos = self.cos[start_pos : start_pos + seq_len, None, :]  # [T, 1, D]
            sin = self.sin[start_pos : start_pos + seq_len, None, :]
        swapped = x.view(batch, seq_len, heads, 2, head_dim // 2).flip(3).view(x.shape)  # (x2, x1)
        return torch.addcmul(x * cos, swapped, sin)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads = cfg.n_heads, cfg.n_kv_heads
        self.head_dim = cfg.resolved_head_dim
        q_width, kv_width = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        # One fused projection for q, k, v: one weight read, one kernel per step (its bias: Qwen2's).
        self.wqkv = nn.Linear(cfg.d_model, q_width + 2 * kv_width, bias=cfg.attention_bias)
        self.wo = nn.Linear(q_width, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor, rope: RotaryTable, cache, start_pos: int) -> torch.Tensor:
        batch, seq_len, _ = x.shape  # x: [B, T, d_model]
        qkv = self.wqkv(x).view(batch, seq_len, self.n_heads + 2 * self.n_kv_heads, self.head_dim)  # [B, T, H + 2 n_kv, D]
        qk = rope.rotate(qkv[:, :, : self.n_heads + self.n_kv_heads], start_pos)  # q and k in one rotation
        q, k = qk.split((self.n_heads, self.n_kv_heads), dim=2)  # [B, T, H, D], [B, T, n_kv, D]
        v = qkv[:, :, self.n_heads + self.n_kv_heads :]  # [B, T, n_kv, D]
        out = cache.attend(q, k, v, start_pos)  # [B, T, H, D]
        return self.wo(out.reshape(batch, seq_len, -1))


class SwiGLU(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        # Gate (w1) and up (w3) projections stacked in one weight [2 * ffn, d_model]: one matmul per step
        # instead of two: the same bytes in fewer calls.
        self.w13 = nn.Linear(cfg.d_model, 2 * cfg.ffn_dim, bias=False)
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.d_model, bias=False)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w13(x).chunk(2, dim=-1)  # [B, T, ffn] each
        return self.w2(F.silu(gate).mul_(up))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.feed_forward = SwiGLU(cfg)

    def forward(self, x: torch.Tensor, rope: RotaryTable, cache, start_pos: int) -> torch.Tensor:
        # The residual stream is updated in place: x is this forward pass's own tensor (the embedding's
        # output, then this loop's), so no step allocates a new one per addition.
        x.add_(self.attention(self.attention_norm(x), rope, cache, start_pos))
        return x.add_(self.feed_forward(self.ffn_norm(x)))


class Decoder(nn.Module):
    """Token ids in, logits of the last position out."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        # An empty table, not nn.Embedding's own normal_ init: build_model seeds every weight itself, and
        # normal_ on the meta device runs through torch._refs, whose first call imports torch._dynamo
        # (over a second of every run's start-up) for values that are discarded.
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.d_model, _weight=torch.empty(cfg.vocab_size, cfg.d_model))
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.output = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.tie_output()

    def tie_output(self) -> None:
        """With cfg.tie_embeddings, the output head reads the embedding table itself (one tensor). Called
        again after the parameters are allocated anew (nn.Module.to_empty makes one tensor per module)."""
        if self.cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight

    @property
    def device(self) -> torch.device:
        return self.tok_embeddings.weight.device  # the embedding is never repacked (harness.model.cpu_linear)

    @property
    def dtype(self) -> torch.dtype:
        return self.tok_embeddings.weight.dtype

    def rotary_table(self, max_len: int) -> RotaryTable:
        c = self.cfg
        return RotaryTable(c.resolved_head_dim, max_len, c.rope_theta, self.device, self.dtype, scaling=c)

    def forward(self, tokens: torch.Tensor, start_pos: int | SequencePositions, caches: Sequence,
                rope: RotaryTable, every_position: bool = False) -> torch.Tensor:
        """tokens [B, T] at positions start_pos.. (or [B, 1], each sequence at its own position:
        SequencePositions) -> logits [B, vocab] of the last position only (every_position: [B, T, vocab],
        a teacher-forced pass scoring each position).

        Prefill needs only the last position's logits to pick the next token, so the output head (the
        largest matmul of a small-batch step) runs on one position, not T.
        """
        h = self.tok_embeddings(tokens)  # [B, T, d_model]
        for layer, cache in zip(self.layers, caches, strict=True):
            h = layer(h, rope, cache, start_pos)
        return self.output(self.norm(h if every_position else h[:, -1]))  # [B, T, vocab] or [B, vocab]

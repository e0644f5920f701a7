"""Quantize and dequantize K/V rows: the pure functions behind the `quantized` strategy.

Everything here is plain torch on tensors whose last dimension is the head dimension D, so the
strategy (strategies.caches.quantized) stores with these functions and the tests use them as the reference
the C kernel (cpu_quantized_attention.c) is checked against.

Formats (symmetric, no zero point: K and V after RoPE are centred, as KIVI and vLLM assume):
- `int8`: code = round(x / s) in [-127, 127], s = amax / 127 over the scale's span.
- `int4`: code = round(x / s) in [-7, 7], s = amax / 7, stored as code + 8 in a nibble, two per byte
  along D: channel 2i in the low nibble of byte i, channel 2i + 1 in the high one.
- `fp8_e4m3`: torch.float8_e4m3fn of x / s, s = amax / 448 (e4m3's largest finite value), as vLLM's
  fp8 KV cache with a scale per token instead of per tensor.

A scale spans either a token's channels (`token` axis: one per (token, KV head), or one per group of
`group_size` channels for int4) or a block of tokens of one channel (`channel` axis, KIVI's keys: one
per channel per block of `block` tokens). Scales are fp32 whatever the compute dtype.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

FORMATS = ("int8", "int4", "fp8_e4m3")
KEY_AXES = ("token", "channel")
CODE_MAX = {"int8": 127.0, "int4": 7.0, "fp8_e4m3": 448.0}  # largest code magnitude a scale maps amax to
VALUE_BITS = {"int8": 8, "int4": 4, "fp8_e4m3": 8}
STORAGE_DTYPE = {"int8": torch.int8, "int4": torch.uint8, "fp8_e4m3": torch.float8_e4m3fn}
SCALE_DTYPE = torch.float32
SCALE_BYTES = 4
INT4_BIAS = 8  # a nibble stores code + 8, so codes -8..7 are 0..15


def payload_width(fmt: str, head_dim: int) -> int:
    """Stored elements (bytes) per row of D channels."""
    return head_dim // 2 if fmt == "int4" else head_dim


def channels_per_scale(fmt: str, head_dim: int, group_size: int) -> int:
    """Channels one token-axis scale spans: a group for int4, the whole row otherwise."""
    return group_size if fmt == "int4" else head_dim


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """codes [..., D] integers in [-8, 7] -> uint8 [..., D/2]: channel 2i low nibble, 2i + 1 high."""
    biased = (codes.to(torch.int16) + INT4_BIAS).to(torch.uint8)  # [..., D] in 0..15
    return biased[..., 0::2] | (biased[..., 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., D/2] -> int8 codes [..., D] in [-8, 7] (inverse of pack_int4)."""
    low = (packed & 15).to(torch.int8) - INT4_BIAS
    high = (packed >> 4).to(torch.int8) - INT4_BIAS
    return torch.stack((low, high), dim=-1).flatten(-2)  # [..., D/2, 2] -> [..., D]


def encode(scaled: torch.Tensor, fmt: str) -> torch.Tensor:
    """fp32 values already divided by their scale [..., D] -> stored payload [..., payload_width]."""
    code_max = CODE_MAX[fmt]
    if fmt == "fp8_e4m3":
        return scaled.clamp(-code_max, code_max).to(torch.float8_e4m3fn)
    codes = scaled.round().clamp(-code_max, code_max).to(torch.int8)
    return pack_int4(codes) if fmt == "int4" else codes


def decode(payload: torch.Tensor, fmt: str) -> torch.Tensor:
    """Stored payload [..., payload_width] -> fp32 codes [..., D] (not yet multiplied by scales)."""
    if fmt == "int4":
        return unpack_int4(payload).float()
    return payload.float()


def _safe(scales: torch.Tensor) -> torch.Tensor:
    # An all-zero span has scale 0; dividing by the smallest normal float instead keeps its codes 0.
    return scales.clamp_min(torch.finfo(SCALE_DTYPE).tiny)


def quantize_per_token(x: torch.Tensor, fmt: str, span: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (payload [..., payload_width], scales [..., D / span]): one scale per `span`
    consecutive channels of each row."""
    groups = x.float().unflatten(-1, (-1, span))  # [..., D/span, span]
    scales = groups.abs().amax(-1) / CODE_MAX[fmt]  # [..., D/span]
    payload = encode((groups / _safe(scales)[..., None]).flatten(-2), fmt)
    return payload, scales


def dequantize_per_token(payload: torch.Tensor, scales: torch.Tensor, fmt: str,
                         dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(payload [..., payload_width], scales [..., n_groups]) -> x_hat [..., D] in `dtype`."""
    codes = decode(payload, fmt).unflatten(-1, (scales.shape[-1], -1))  # [..., n_groups, span]
    return (codes * scales[..., None]).flatten(-2).to(dtype)


def quantize_per_channel(x: torch.Tensor, fmt: str, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., n_blocks * block, D] -> (payload [..., n_blocks * block, payload_width],
    scales [..., n_blocks, D]): one scale per channel per block of `block` tokens (KIVI's keys)."""
    blocks = x.float().unflatten(-2, (-1, block))  # [..., n_blocks, block, D]
    scales = blocks.abs().amax(-2) / CODE_MAX[fmt]  # [..., n_blocks, D]
    payload = encode((blocks / _safe(scales)[..., None, :]).flatten(-3, -2), fmt)
    return payload, scales


def dequantize_per_channel(payload: torch.Tensor, scales: torch.Tensor, fmt: str,
                           dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(payload [..., n_blocks * block, payload_width], scales [..., n_blocks, D]) -> x_hat [..., T, D]."""
    codes = decode(payload, fmt)  # [..., T, D]
    if codes.shape[-2] == 0:  # no whole block yet (the block length cannot be inferred from none)
        return codes.to(dtype)
    codes = codes.unflatten(-2, (scales.shape[-2], -1))  # [..., n_blocks, block, D]
    return (codes * scales[..., None, :]).flatten(-3, -2).to(dtype)


@dataclass(frozen=True)
class QuantSpec:
    """How one cache stores K and V: format, int4 group, key scale axis, residual length."""

    format: str = "int8"
    group_size: int = 32  # channels per scale (int4, token axis)
    key_axis: str = "token"  # token: per (token, head[, group]); channel: per channel per `residual` tokens
    residual: int = 0  # most recent tokens kept in the compute dtype; blocks of this many are quantized

    @property
    def value_bits(self) -> int:
        return VALUE_BITS[self.format]

    def span(self, head_dim: int) -> int:
        return channels_per_scale(self.format, head_dim, self.group_size)

    def key_scale_bytes_per_token(self, head_dim: int) -> float:
        if self.key_axis == "channel":
            return SCALE_BYTES * head_dim / self.residual  # D scales per block of `residual` tokens
        return SCALE_BYTES * head_dim // self.span(head_dim)

    def value_scale_bytes_per_token(self, head_dim: int) -> float:
        return SCALE_BYTES * head_dim // self.span(head_dim)

    def scale_bytes_per_token(self, head_dim: int) -> float:
        """Bytes of scales per token and KV head, K and V together (CacheLayout.scale_bytes_per_token)."""
        return self.key_scale_bytes_per_token(head_dim) + self.value_scale_bytes_per_token(head_dim)

    def quantize_keys(self, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k [..., T, D] (T a multiple of `residual` on the channel axis) -> (payload, scales)."""
        if self.key_axis == "channel":
            return quantize_per_channel(k, self.format, self.residual)
        return quantize_per_token(k, self.format, self.span(k.shape[-1]))

    def quantize_values(self, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return quantize_per_token(v, self.format, self.span(v.shape[-1]))

    def dequantize_keys(self, payload, scales, dtype=torch.float32) -> torch.Tensor:
        if self.key_axis == "channel":
            return dequantize_per_channel(payload, scales, self.format, dtype)
        return dequantize_per_token(payload, scales, self.format, dtype)

    def dequantize_values(self, payload, scales, dtype=torch.float32) -> torch.Tensor:
        return dequantize_per_token(payload, scales, self.format, dtype)

"""The slots an evicting cache (strategies.caches.eviction) keeps its tokens in: K/V in the compute dtype, or
quantized per token with strategies.caches.quantization's functions (so a budget policy composes with a
format). Slots are rows of tables preallocated per layer; a token is written into a free slot and
stays there until a policy frees it, so no step moves the others.
"""
from __future__ import annotations

import torch

from harness.model.random_fill import uniform_like_normal_
from strategies.caches import quantization
from strategies.caches.quantization import QuantSpec


def _scatter_rows(table: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """table [B, n_kv, S, W], slots [B, n_kv] int64, rows [B, n_kv, 1, W]: row (b, h) into slot slots[b, h]."""
    if table.dtype in (torch.float8_e4m3fn,):  # scatter takes no float8: move its bytes
        table, rows = table.view(torch.uint8), rows.view(torch.uint8)
    table.scatter_(2, slots[:, :, None, None].expand(*rows.shape), rows)


class FullWidthSlots:
    """K and V [B, n_kv, S, D] in the compute dtype; a read is a view of the filled slots."""

    format, span = "", 0  # no per-token format (the compacted-slot kernel's fp32 slots)

    def __init__(self, batch: int, n_kv: int, slots: int, head_dim: int, device, dtype):
        # zeros, not empty: resident from the start, as contiguous's tables are
        self.k = torch.zeros(batch, n_kv, slots, head_dim, device=device, dtype=dtype)  # [B, n_kv, S, D]
        self.v = torch.zeros(batch, n_kv, slots, head_dim, device=device, dtype=dtype)  # [B, n_kv, S, D]

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    @property
    def tables(self) -> tuple[torch.Tensor, ...]:
        """Every tensor the slots hold (a snapshot copies them)."""
        return self.k, self.v

    @property
    def kernel_tables(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The key and value tables as the compacted-slot kernel takes them (strategies.caches.compacted_kernel)."""
        return [self.k], [self.v]

    def write(self, k: torch.Tensor, v: torch.Tensor, start: int) -> None:
        """k, v [B, n_kv, T, D] into slots start .. start + T."""
        self.k[:, :, start:start + k.shape[2]] = k
        self.v[:, :, start:start + v.shape[2]] = v

    def scatter(self, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """k, v [B, n_kv, 1, D], each sequence and KV head into its own slot (slots [B, n_kv])."""
        _scatter_rows(self.k, slots, k)
        _scatter_rows(self.v, slots, v)

    def read(self, filled: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V [B, n_kv, filled, D] as stored (views: writing into K writes the table)."""
        return self.k[:, :, :filled], self.v[:, :, :filled]

    def fill_random(self, filled: int, generator: torch.Generator) -> None:
        for table in (self.k, self.v):
            uniform_like_normal_(table[:, :, :filled], 1.0, generator)


class QuantizedSlots:
    """K and V quantized per token (QuantSpec on the token axis, no residual: a slot is freed
    one token at a time, which block-scaled keys cannot follow); a read dequantizes the filled slots."""

    def __init__(self, batch: int, n_kv: int, slots: int, head_dim: int, device, dtype, spec: QuantSpec):
        self.spec, self.dtype, self.head_dim = spec, dtype, head_dim
        self.format, self.span = spec.format, spec.span(head_dim)  # as the compacted-slot kernel reads them
        width, groups = quantization.payload_width(spec.format, head_dim), head_dim // spec.span(head_dim)
        storage = quantization.STORAGE_DTYPE[spec.format]
        self.payloads = [torch.zeros(batch, n_kv, slots, width, device=device, dtype=storage)
                         for _ in range(2)]  # K, V: [B, n_kv, S, W]
        self.scales = [torch.zeros(batch, n_kv, slots, groups, device=device, dtype=quantization.SCALE_DTYPE)
                       for _ in range(2)]  # K, V: [B, n_kv, S, D/span]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tables)

    @property
    def tables(self) -> tuple[torch.Tensor, ...]:
        """Every tensor the slots hold (a snapshot copies them)."""
        return (*self.payloads, *self.scales)

    @property
    def kernel_tables(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """[payload, scales] of K and of V, as the compacted-slot kernel takes them."""
        return [self.payloads[0], self.scales[0]], [self.payloads[1], self.scales[1]]

    def _quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return quantization.quantize_per_token(x, self.spec.format, self.spec.span(x.shape[-1]))

    def write(self, k: torch.Tensor, v: torch.Tensor, start: int) -> None:
        for x, payload, scales in zip((k, v), self.payloads, self.scales):
            codes, x_scales = self._quantize(x)
            payload[:, :, start:start + x.shape[2]] = codes
            scales[:, :, start:start + x.shape[2]] = x_scales

    def scatter(self, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        for x, payload, scales in zip((k, v), self.payloads, self.scales):
            codes, x_scales = self._quantize(x)
            _scatter_rows(payload, slots, codes)
            _scatter_rows(scales, slots, x_scales)

    def read(self, filled: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V [B, n_kv, filled, D] dequantized into new tensors of the compute dtype."""
        k, v = (quantization.dequantize_per_token(payload[:, :, :filled], scales[:, :, :filled], self.spec.format,
                                                  self.dtype)
                for payload, scales in zip(self.payloads, self.scales))
        return k, v

    def fill_random(self, filled: int, generator: torch.Generator) -> None:
        """Valid codes and positive scales (a step's time does not depend on the values)."""
        x = torch.empty(*self.payloads[0].shape[:2], filled, self.head_dim, device=self.payloads[0].device)  # [B, n_kv, n, D]
        for index in range(2):
            uniform_like_normal_(x, 1.0, generator)
            codes, scales = self._quantize(x)
            self.payloads[index][:, :, :filled] = codes
            self.scales[index][:, :, :filled] = scales

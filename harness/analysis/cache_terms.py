"""The cache's terms of the analytic model, one function per term, each reading a CacheLayout.

A layout (harness.config.CacheLayout, declared by each strategy) says how K/V are stored: in whole
blocks (paged), over a preallocated max_len that every step reads (static_full), copied into a new
table every step (dynamic), at fewer bits with scales and a full-width window of recent tokens
(quantized). `None` is no cache at all. The analytic model (harness.analysis.analytic) adds these
terms to a step's bytes and FLOPs; nothing else special-cases a layout. Pure: no torch.
"""
from __future__ import annotations

from typing import Optional, Protocol

from harness.config.layout import CacheLayout

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


class Shape(Protocol):
    """What the analytic model needs of a decoder shape (harness.config.ModelConfig satisfies it)."""

    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int

    @property
    def resolved_head_dim(self) -> int: ...


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of a dtype name (float32, bfloat16, float16)."""
    try:
        return DTYPE_BYTES[dtype]
    except KeyError:
        raise ValueError(f"dtype: unknown '{dtype}', allowed: {', '.join(DTYPE_BYTES)}") from None


def full_width_bytes_per_token(shape: Shape, dtype: str) -> int:
    """One key and one value vector per layer and KV head, in the compute dtype:
    2 x n_layers x n_kv_heads x head_dim x bytes per element."""
    return 2 * shape.n_layers * shape.n_kv_heads * shape.resolved_head_dim * dtype_bytes(dtype)


def stored_bytes_per_token(shape: Shape, dtype: str, layout: CacheLayout) -> float:
    """Bytes per token as the layout stores it: 2 x L x n_kv x (D x bits / 8 + scale bytes), the
    scale bytes being per token and KV head for K and V together (hence halved inside the sum)."""
    if not layout.value_bits:
        return full_width_bytes_per_token(shape, dtype)
    per_head = 2 * shape.resolved_head_dim * layout.value_bits / 8 + layout.scale_bytes_per_token
    return shape.n_layers * shape.n_kv_heads * per_head


def window_tokens(layout: CacheLayout, tokens: int) -> int:
    """Tokens of a sequence of `tokens` held at full width in the residual window (quantized)."""
    return tokens % layout.residual_tokens if layout.residual_tokens else 0


def span(layout: CacheLayout, max_len: int) -> int:
    """Positions preallocated per sequence: the layout's own, or the point's max_len."""
    return max(layout.preallocated_tokens, max_len)


def allocated_tokens(layout: CacheLayout, tokens: int) -> int:
    """Token slots allocated for a sequence of `tokens`: rounded up to whole blocks (paged), or the
    layout's preallocated positions when it has more."""
    tokens = max(tokens, layout.preallocated_tokens)
    blocks = -(-tokens // layout.block_size)
    return blocks * layout.block_size


def cache_bytes(shape: Shape, dtype: str, batch: int, tokens: int, layout: Optional[CacheLayout]) -> float:
    """Bytes a cache of `batch` sequences of `tokens` tokens holds: allocated slots at the stored width,
    plus the residual window buffer at full width (allocated whole, whatever its fill)."""
    if layout is None:
        return 0
    stored = batch * allocated_tokens(layout, tokens) * stored_bytes_per_token(shape, dtype, layout)
    window = batch * layout.residual_tokens * full_width_bytes_per_token(shape, dtype)
    return stored + window


def read_bytes(shape: Shape, dtype: str, batch: int, context: int, max_len: int,
               layout: Optional[CacheLayout]) -> float:
    """Cache bytes attention reads at a step over `context` cached tokens: the filled prefix (every
    preallocated position with reads_max_len), the window's tokens at full width."""
    if layout is None:
        return 0
    tokens = span(layout, max_len) if layout.reads_max_len else context
    window = window_tokens(layout, tokens)
    stored = (tokens - window) * stored_bytes_per_token(shape, dtype, layout)
    return batch * (stored + window * full_width_bytes_per_token(shape, dtype))


def write_bytes(shape: Shape, dtype: str, batch: int, layout: Optional[CacheLayout]) -> float:
    """Cache bytes a step writes: one new token per sequence, into the window (full width) when the
    layout has one, else at the stored width."""
    if layout is None:
        return 0
    if layout.residual_tokens:
        return batch * full_width_bytes_per_token(shape, dtype)
    return batch * stored_bytes_per_token(shape, dtype, layout)


def copy_bytes(shape: Shape, dtype: str, batch: int, context: int, layout: Optional[CacheLayout]) -> float:
    """Bytes of the per-step copy of a cache that grows by concatenation (dynamic): the old table
    read (context tokens) and the new one written (context + 1 tokens), for K and V of every layer."""
    if layout is None or not layout.copies_per_step:
        return 0
    return batch * (2 * context + 1) * stored_bytes_per_token(shape, dtype, layout)


def attended_keys(context: int, max_len: int, layout: Optional[CacheLayout]) -> int:
    """Keys one decode query is scored against: its context and itself, or every preallocated
    position (reads_max_len: the masked ones are computed, then discarded)."""
    if layout is not None and layout.reads_max_len:
        return span(layout, max_len)
    return context + 1


def mean_window_tokens(layout: CacheLayout, first_context: int, steps: int) -> float:
    """Mean over the contexts first_context .. first_context + steps - 1 of the tokens in the residual
    window (context mod residual), in closed form."""
    size = layout.residual_tokens
    if not size:
        return 0.0

    def below(m: int) -> int:  # sum of (c mod size) over c = 0 .. m - 1
        full, rest = divmod(m, size)
        return full * size * (size - 1) // 2 + rest * (rest - 1) // 2

    return (below(first_context + steps) - below(first_context)) / steps

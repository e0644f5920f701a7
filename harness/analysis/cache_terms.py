"""The cache's terms of the analytic model, one function per term, each reading a CacheLayout.

A layout (harness.config.CacheLayout, declared by each strategy) says how K/V are stored: in whole
blocks (paged), over a preallocated max_len that every step reads (static_full), copied into a new
table every step (dynamic), at fewer bits with scales and a full-width residual of recent tokens
(quantized), for at most a budget of tokens per sequence (eviction), for fewer layers (cross-layer
sharing) or fewer key channels (key pruning). `None` is no cache at all. The analytic model
(harness.analysis.analytic) adds these terms to a step's bytes and FLOPs; nothing else special-cases a
layout. Pure: no torch.
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


# Arithmetic an eviction score adds per query head, cached key and layer at each decode step: one add of
# the step's attention probability into the key's score (H2O accumulates it; TOVA averages the current
# one over the heads) and one compare to find the lowest. Recency needs none; SnapKV scores once, at
# the end of prefill, from the observation window's queries, never in a decode step.
SCORE_FLOPS_PER_KEY = {"": 0, "recency": 0, "accumulated_attention": 2, "current_attention": 2,
                       "observation_window": 0}


def stored_layers(shape: Shape, layout: CacheLayout) -> int:
    """Layers that store their own K/V: every layer, or the layout's layers_stored (cross-layer sharing)."""
    return layout.layers_stored or shape.n_layers


def stored_channels(shape: Shape, layout: CacheLayout) -> int:
    """Numbers stored per token, KV head and layer: the key's kept channels (key_channels_kept, or every
    one) and the value's head_dim."""
    return (layout.key_channels_kept or shape.resolved_head_dim) + shape.resolved_head_dim


def full_width_bytes_per_token(shape: Shape, dtype: str, layout: Optional[CacheLayout] = None) -> int:
    """One key and one value vector per layer and KV head, in the compute dtype:
    2 x n_layers x n_kv_heads x head_dim x bytes per element; with a layout, only the layers and key
    channels it stores."""
    if layout is None:
        return 2 * shape.n_layers * shape.n_kv_heads * shape.resolved_head_dim * dtype_bytes(dtype)
    return stored_layers(shape, layout) * shape.n_kv_heads * stored_channels(shape, layout) * dtype_bytes(dtype)


def stored_bytes_per_token(shape: Shape, dtype: str, layout: CacheLayout) -> float:
    """Bytes per token as the layout stores it: L x n_kv x (channels x bits / 8 + scale bytes) over the
    layers and channels it stores (2 x head_dim channels when it keeps them all), the scale bytes being
    per token and KV head for K and V together."""
    if not layout.value_bits:
        return full_width_bytes_per_token(shape, dtype, layout)
    per_head = stored_channels(shape, layout) * layout.value_bits / 8 + layout.scale_bytes_per_token
    return stored_layers(shape, layout) * shape.n_kv_heads * per_head


def kept_tokens(layout: Optional[CacheLayout], tokens: int) -> int:
    """Tokens a sequence of `tokens` keeps in the cache: all of them, or at most the token budget."""
    if layout is None or not layout.token_budget:
        return tokens
    return min(tokens, layout.token_budget)


def summed_attended_keys(first_context: int, steps: int, layout: Optional[CacheLayout]) -> int:
    """Sum over the steps at contexts first_context .. + steps - 1 of the keys each query is scored
    against (its kept context and itself), in closed form: a line up to the budget, flat after it."""
    below = steps if layout is None or not layout.token_budget else min(max(layout.token_budget - first_context, 0), steps)
    growing = (2 * first_context + below + 1) * below // 2  # sum of c + 1 over the contexts below the budget
    return growing + (steps - below) * (kept_tokens(layout, first_context + steps) + 1)


def scoring_flops_per_key(shape: Shape, layout: Optional[CacheLayout]) -> int:
    """FLOPs an eviction score adds per cached key at a decode step, over every query head and layer."""
    score = SCORE_FLOPS_PER_KEY[layout.eviction_score] if layout is not None else 0
    return score * shape.n_heads * shape.n_layers


def window_tokens(layout: CacheLayout, tokens: int) -> int:
    """Tokens of a sequence of `tokens` held at full width in the residual (quantized)."""
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


def slot_bytes_per_token(shape: Shape, layout: CacheLayout) -> int:
    """An evicting cache's bookkeeping per kept token, over its layers and KV heads: each token's
    position and score (layout.slot_bytes), beside its K/V."""
    return stored_layers(shape, layout) * shape.n_kv_heads * layout.slot_bytes


def cache_bytes(shape: Shape, dtype: str, batch: int, tokens: int, layout: Optional[CacheLayout]) -> float:
    """Bytes a cache of `batch` sequences of `tokens` tokens holds: allocated slots at the stored width
    and their bookkeeping (eviction), plus the residual buffer at full width (allocated whole, whatever
    its fill)."""
    if layout is None:
        return 0
    per_token = stored_bytes_per_token(shape, dtype, layout) + slot_bytes_per_token(shape, layout)
    stored = batch * allocated_tokens(layout, kept_tokens(layout, tokens)) * per_token
    window = batch * layout.residual_tokens * full_width_bytes_per_token(shape, dtype, layout)
    return stored + window


def read_bytes(shape: Shape, dtype: str, batch: int, context: int, max_len: int,
               layout: Optional[CacheLayout]) -> float:
    """Cache bytes attention reads at a step over `context` cached tokens: the filled prefix (every
    preallocated position with reads_max_len), the window's tokens at full width."""
    if layout is None:
        return 0
    tokens = span(layout, max_len) if layout.reads_max_len else kept_tokens(layout, context)
    window = window_tokens(layout, tokens)
    stored = (tokens - window) * stored_bytes_per_token(shape, dtype, layout)
    return batch * (stored + window * full_width_bytes_per_token(shape, dtype, layout))


def bookkeeping_bytes(shape: Shape, batch: int, context: int, max_len: int, layout: Optional[CacheLayout]) -> float:
    """Bytes an evicting cache's policy moves at a step over `context` cached tokens beyond the K/V: the
    position and score of every token the query is scored against (its kept context and itself) read
    to choose the slot to free, and the step's weights written into the scores where the policy scores
    by them. The logits the kernel keeps for those weights stay in the core's cache: not counted."""
    if layout is None or not (layout.slot_bytes or layout.slot_write_bytes):
        return 0
    per_token = stored_layers(shape, layout) * shape.n_kv_heads * (layout.slot_bytes + layout.slot_write_bytes)
    return batch * attended_keys(context, max_len, layout) * per_token


def write_bytes(shape: Shape, dtype: str, batch: int, layout: Optional[CacheLayout]) -> float:
    """Cache bytes a step writes: one new token per sequence, into the window (full width) when the
    layout has one, else at the stored width."""
    if layout is None:
        return 0
    if layout.residual_tokens:
        return batch * full_width_bytes_per_token(shape, dtype, layout)
    return batch * stored_bytes_per_token(shape, dtype, layout)


def copy_bytes(shape: Shape, dtype: str, batch: int, context: int, layout: Optional[CacheLayout]) -> float:
    """Bytes of the per-step copy of a cache that grows by concatenation (dynamic): the old table
    read (context tokens) and the new one written (context + 1 tokens), for K and V of every layer."""
    if layout is None or not layout.copies_per_step:
        return 0
    return batch * (2 * kept_tokens(layout, context) + 1) * stored_bytes_per_token(shape, dtype, layout)


def attended_keys(context: int, max_len: int, layout: Optional[CacheLayout]) -> int:
    """Keys one decode query is scored against: its kept context and itself, or every preallocated
    position (reads_max_len: the masked ones are computed, then discarded)."""
    if layout is not None and layout.reads_max_len:
        return span(layout, max_len)
    return kept_tokens(layout, context) + 1


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

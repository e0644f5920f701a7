"""What compressing the cache can buy at a point, per the analytic model: the share of a decode step's
bytes that is cache (the ceiling on any compression's saving there), the context at which a batch's
cache weighs as much as the weights, as stored by a layout (kept tokens, layers, key channels, format)
and exact, and the step's bytes against the exact cache's.

A compressed cache saves at most the cache's share of the step: with fp32 weights, SmolLM2-135M reads
about 538 MB of weights a step, so at batch 4 and ctx 1024 the exact cache is about a quarter of the
bytes and even a cache compressed to nothing would make the step about a quarter faster. The share
grows with batch x context; the crossover context (`context_to_match_weights`) says where the cache
starts to dominate, and a layout moves it out by the factor it stores less, or to never when a token
budget keeps the cache below the weights at any length. Pure: no torch.
"""
from __future__ import annotations

from typing import Optional

from harness.analysis import analytic, cache_terms
from harness.analysis.cache_terms import Shape
from harness.config.layout import CONTIGUOUS, CacheLayout


def cache_share_of_step_bytes(shape: Shape, dtype: str, batch: int, ctx: int, steps: int,
                              layout: Optional[CacheLayout]) -> float:
    """Share of the mean decode step's bytes (analytic.mean_decode_step) that is cache (read, written,
    copied), the rest being weights: the most a compression of this cache could save of the step."""
    mean = analytic.mean_decode_step(shape, dtype, batch, ctx, steps, layout).bytes
    return 1 - analytic.decode_weight_bytes(shape, dtype, batch) / mean


def context_to_match_weights(shape: Shape, dtype: str, batch: int, layout: CacheLayout = CONTIGUOUS) -> Optional[float]:
    """Tokens per sequence at which `batch` sequences' cache, as the layout stores it (bytes per token of
    the layers, key channels and format it keeps), weighs as much as the weights a decode step reads
    (analytic.decode_weight_bytes: where the cache becomes half the step's bytes); None when the
    layout's token budget holds the cache below them at every length. A quantized layout's full-width
    window of recent tokens is left out (a few dozen tokens, against thousands)."""
    per_token = batch * cache_terms.stored_bytes_per_token(shape, dtype, layout)
    tokens = analytic.decode_weight_bytes(shape, dtype, batch) / per_token
    if layout.token_budget and tokens > layout.token_budget:
        return None
    return tokens


def step_bytes_ratio(shape: Shape, dtype: str, batch: int, ctx: int, steps: int, layout: Optional[CacheLayout],
                     reference: Optional[CacheLayout] = CONTIGUOUS) -> float:
    """The mean decode step's bytes with `layout` over those with `reference` (the exact contiguous cache):
    the step-time ratio a memory-bound step would show."""
    mean = lambda storage: analytic.mean_decode_step(shape, dtype, batch, ctx, steps, storage).bytes  # noqa: E731
    return mean(layout) / mean(reference)


def compression_figures(shape: Shape, dtype: str, batch: int, ctx: int, decode_tokens: int,
                        layout: Optional[CacheLayout]) -> dict:
    """The analytic CLI's figures of what the layout keeps and what compressing can buy at the point."""
    if layout is None:
        return dict.fromkeys(("kept_tokens_per_sequence", "layers_stored", "key_channels_stored",
                              "cache_share_of_step_bytes", "step_bytes_ratio_to_exact", "context_to_match_weights",
                              "context_to_match_weights_exact"))
    return {
        "kept_tokens_per_sequence": cache_terms.kept_tokens(layout, ctx + decode_tokens),
        "layers_stored": cache_terms.stored_layers(shape, layout),
        "key_channels_stored": layout.key_channels_kept or shape.resolved_head_dim,
        "cache_share_of_step_bytes": cache_share_of_step_bytes(shape, dtype, batch, ctx, decode_tokens, layout),
        "step_bytes_ratio_to_exact": step_bytes_ratio(shape, dtype, batch, ctx, decode_tokens, layout),
        "context_to_match_weights": context_to_match_weights(shape, dtype, batch, layout),
        "context_to_match_weights_exact": context_to_match_weights(shape, dtype, batch),
    }

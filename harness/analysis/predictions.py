"""Every prediction a row is set against, from one definition each: the run writes them as the row's
columns (harness.run.row), and the loader's one re-prediction step (harness.analysis.results,
`fallback_hardware` or rows written without them) calls the same function at a datasheet's roof.

The predicted decode step is the mean over the timed steps of each step's roofline time: for each of
its two phases, the matmuls with the weights and attention over the cache, the larger of its bytes over
the read roof and its FLOPs over the FLOP roof, summed (analytic.mean_decode_step; why phases:
harness.analysis.roofline). It is set against `decode_step_s`, the mean of those same steps, so it
must be a mean of steps: a step bound by compute cannot lend its idle bandwidth to the next one, which
makes the roofline time of the mean bytes and FLOPs (max of means) too low wherever the steps cross
the ridge, and the sum of bytes time and FLOPs time (no overlap at all, not even inside one phase) an
upper bound rather than a prediction.
"""
from __future__ import annotations

from harness.analysis import analytic, compression
from harness.analysis.analytic import Roof

ROOF_FREE = ("weight_bytes", "kv_bytes_per_token", "tokens_to_match_weights", "kv_cache_bytes_model",
             "bytes_per_step_model", "flops_per_step_model", "kv_bytes_per_token_held", "kv_cache_used_bytes_model",
             "cache_share_of_step_bytes", "context_to_match_weights", "accuracy_kv_bytes_per_token_held")
AT_A_ROOF = ("predicted_step_s", "predicted_prefill_s", "roof_bound")


def predict(shape, dtype: str, batch: int, ctx: int, decode_tokens: int, layout, roof: Roof | None = None,
            scored_tokens: int | None = None) -> dict:
    """The prediction columns of a point (ROOF_FREE, and AT_A_ROOF: null without a roof); `layout` None:
    no cache. A sequence ends holding ctx + decode_tokens tokens, what a preallocated cache spans;
    `scored_tokens`: what a sequence of the point's accuracy pass ends holding (accuracy_ctx +
    accuracy_steps; None: no pass ran)."""
    steps = max(int(decode_tokens), 1)
    tokens = ctx + steps
    step = analytic.mean_decode_step(shape, dtype, batch, ctx, steps, layout, roof)
    cached = layout is not None
    columns = {
        "weight_bytes": analytic.weight_bytes(shape, dtype),
        # the shape's own figures, whatever the layout: what any exact cache stores per token, and how many
        # such tokens (any batch x length) weigh as much as the weights
        "kv_bytes_per_token": analytic.kv_bytes_per_token(shape, dtype),
        "tokens_to_match_weights": analytic.tokens_to_match_weights(shape, dtype),
        "kv_cache_bytes_model": round(analytic.kv_cache_bytes(shape, dtype, batch, tokens, layout)),
        "bytes_per_step_model": round(step.bytes),
        "flops_per_step_model": step.flops,
        "kv_bytes_per_token_held": analytic.kv_bytes_per_token_held(shape, dtype, tokens, layout) if cached else None,
        "accuracy_kv_bytes_per_token_held": analytic.kv_bytes_per_token_held(shape, dtype, scored_tokens, layout)
        if cached and scored_tokens else None,
        "kv_cache_used_bytes_model": analytic.kv_cache_used_bytes(shape, dtype, batch, tokens, layout) if cached else None,
        # the ceiling on what any compression of this point can buy, and where its cache outweighs the weights
        "cache_share_of_step_bytes": compression.cache_share_of_step_bytes(shape, dtype, batch, ctx, steps, layout),
        "context_to_match_weights": compression.context_to_match_weights(shape, dtype, batch, layout) if cached else None,
        **dict.fromkeys(AT_A_ROOF),
    }
    if roof is not None:
        columns.update(predicted_step_s=step.seconds,
                       predicted_prefill_s=analytic.prefill_time(shape, dtype, batch, ctx, roof, layout),
                       roof_bound=analytic.phased_bound(step.phases, roof))
    return columns

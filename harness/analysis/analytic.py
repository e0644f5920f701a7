"""Analytic model of a Llama-3-style decoder: parameters, bytes and FLOPs. Pure functions, no torch.

Conventions (one each, used everywhere in the harness):
- Parameters count every weight: embedding, per-layer attention (wq, wk, wv, wo) and SwiGLU MLP
  (w1, w2, w3), both RMSNorm weights per layer, the final norm and the untied output head.
- A decode step reads every weight except the embedding table, of which it reads only the rows of the
  tokens it embeds (batch rows). The embedding lookup is a gather, not a matmul: it costs no FLOPs.
- Bytes count weights and K/V cache entries only; activations are not counted.
- FLOPs: 2 per multiply-add, matmuls and attention's QK^T/PV only; see the FLOPs section below for the
  exact list and for how positions are numbered (decode step i of a p-token prompt sits at context p+i).
- Roofline time of a step = the sum over its two phases, the matmuls with the weights and attention
  over the cache, of max(FLOPs / peak FLOP/s, bytes / bandwidth) (harness.analysis.roofline says
  why); totals sum per-step times.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional

from harness.analysis import cache_terms
from harness.analysis.cache_terms import DTYPE_BYTES, Shape, dtype_bytes  # noqa: F401 (re-exported)
from harness.analysis.roofline import (Phase, Roof, bound, intensity, phased_bound,  # noqa: F401 (re-exported)
                                       phased_time, roofline_time, summed_max)
from harness.config.layout import CONTIGUOUS, CacheLayout

Layout = Optional[CacheLayout]  # how a strategy stores K/V; None: no cache (every step recomputes)


def layer_params(shape: Shape) -> int:
    """Weights of one decoder block: attention projections, SwiGLU MLP, two RMSNorm vectors."""
    d, hd = shape.d_model, shape.resolved_head_dim
    attention = d * shape.n_heads * hd + 2 * d * shape.n_kv_heads * hd + shape.n_heads * hd * d
    mlp = 3 * d * shape.ffn_dim
    return attention + mlp + 2 * d


def embedding_params(shape: Shape) -> int:
    return shape.vocab_size * shape.d_model


def params(shape: Shape) -> int:
    """All parameters: embedding + blocks + final norm + untied output head."""
    head = shape.vocab_size * shape.d_model
    return embedding_params(shape) + shape.n_layers * layer_params(shape) + shape.d_model + head


def weight_bytes(shape: Shape, dtype: str) -> int:
    """Bytes of all weights resident in memory."""
    return params(shape) * dtype_bytes(dtype)


def decode_weight_bytes(shape: Shape, dtype: str, batch: int) -> int:
    """Weight bytes one decode step reads: all but the embedding table, plus `batch` embedding rows."""
    read = params(shape) - embedding_params(shape) + batch * shape.d_model
    return read * dtype_bytes(dtype)


def kv_bytes_per_token(shape: Shape, dtype: str, layout: CacheLayout = CONTIGUOUS) -> float:
    """Cache bytes per token: one key and one value vector per layer and KV head, at the layout's
    stored width (the compute dtype's unless quantized; scales included)."""
    return cache_terms.stored_bytes_per_token(shape, dtype, layout)


def kv_cache_bytes(shape: Shape, dtype: str, batch: int, tokens: int, layout: Layout = CONTIGUOUS) -> float:
    """Cache bytes allocated for `batch` sequences of `tokens` tokens: for a contiguous cache only
    batch * tokens matters; paged rounds each sequence up to whole blocks, quantized adds its window."""
    return cache_terms.cache_bytes(shape, dtype, batch, tokens, layout)


def kv_cache_used_bytes(shape: Shape, dtype: str, batch: int, tokens: int, layout: Layout = CONTIGUOUS) -> float:
    """Cache bytes the tokens themselves need at the layout's stored width, without whole blocks or
    preallocated positions: set against kv_cache_bytes, the allocation's overhead (paged fragmentation,
    a static table's unfilled max_len)."""
    if layout is None:
        return 0
    exact = dataclasses.replace(layout, block_size=1, preallocated_tokens=0)
    return cache_terms.cache_bytes(shape, dtype, batch, tokens, exact)


def kv_bytes_per_token_held(shape: Shape, dtype: str, tokens: int, layout: CacheLayout = CONTIGUOUS) -> float:
    """Cache bytes per token of a sequence holding `tokens` tokens: kv_cache_used_bytes spread over them,
    so a quantized layout's full-width residual of recent tokens counts (it weighs most at short
    contexts), while whole blocks and preallocated positions, which say how a cache allocates and not
    what it stores, do not."""
    return kv_cache_used_bytes(shape, dtype, 1, tokens, layout) / tokens


def decode_step_bytes(shape: Shape, dtype: str, batch: int, context: int, layout: Layout = CONTIGUOUS,
                      max_len: Optional[int] = None) -> dict:
    """Bytes one decode step must move, by part.

    With a cache, the step at `context` cached tokens reads the weights and the cache (its filled
    prefix, or all `max_len` positions for a layout that reads them), writes one new K/V entry per
    sequence, for a cache grown by concatenation copies the whole cache, and for an evicting cache
    reads each kept token's position and score and writes the step's weights into the scores. Without a cache
    (layout None) it re-reads the weights once (the prefix is recomputed in one pass) and moves no
    cache. Activations are not counted in either case.
    """
    weights = decode_weight_bytes(shape, dtype, batch)
    parts = {
        "weights": weights,
        "cache_read": cache_terms.read_bytes(shape, dtype, batch, context, max_len or context + 1, layout),
        "cache_write": cache_terms.write_bytes(shape, dtype, batch, layout),
        "cache_copy": cache_terms.copy_bytes(shape, dtype, batch, context, layout),
        "cache_bookkeeping": cache_terms.bookkeeping_bytes(shape, batch, context, max_len or context + 1, layout),
    }
    return {**parts, "total": sum(parts.values())}


# --- FLOPs -------------------------------------------------------------------------------------------
#
# Conventions for FLOPs (one each, stated once):
# - A multiply-add is 2 FLOPs; a matmul of a token through an [in, out] weight costs 2 * in * out.
# - Counted: the projections (wq, wk, wv, wo), the SwiGLU matmuls (w1, w2, w3), the output head, and
#   attention's two matmuls: QK^T and PV, 2 * n_heads * head_dim FLOPs each per (query, key) pair,
#   so 4 * t * n_heads * head_dim per layer for one query over t keys.
# - Not counted: the embedding gather, RMSNorm, RoPE, softmax, SiLU, residual adds (all O(d) per token,
#   under 1% of the matmuls at any published shape).
# - Causal: the query at position j sees keys 0..j, i.e. j + 1 keys (itself included).
# - The output head runs on the last position of a forward pass only (harness.model.Decoder does the
#   same: only the last position's logits pick the next token), so a forward pass of T tokens costs
#   one head matmul per sequence, not T.
#
# Positions of a generation with a p-token prompt and n decode steps:
# - prefill: one forward pass over positions 0..p-1 (writes p cache entries when cached).
# - decode step i, i = 0..n-1, feeds the token at position p + i ("context" c = p + i: the tokens
#   before it). Cached: one token, one query over c cached keys plus its own (c + 1 keys), reading the
#   c cached entries and writing one. No cache: a forward pass over all c + 1 tokens from position 0.


def matmul_params(shape: Shape) -> int:
    """Weights one token is multiplied by in a forward pass: the blocks' projections and MLPs and the
    output head. Excludes the embedding (a gather) and the RMSNorm vectors (elementwise)."""
    per_layer = layer_params(shape) - 2 * shape.d_model
    return shape.n_layers * per_layer + shape.vocab_size * shape.d_model


def causal_pairs(start: int, new: int) -> int:
    """(query, key) pairs when `new` queries at positions start..start+new-1 attend causally:
    sum over j of (j + 1) = new * start + new * (new + 1) / 2."""
    return new * start + new * (new + 1) // 2


def attention_flops_per_pair(shape: Shape) -> int:
    """QK^T plus PV over all layers for one (query, key) pair: 4 * n_heads * head_dim per layer."""
    return 4 * shape.n_layers * shape.n_heads * shape.resolved_head_dim


def forward_matmul_flops(shape: Shape, batch: int, new: int) -> int:
    """FLOPs of the matmuls with the weights in one forward pass of `new` tokens: every block's for each
    token, the output head's for the last position only."""
    per_layer_matmuls = 2 * new * (matmul_params(shape) - shape.vocab_size * shape.d_model)
    head = 2 * shape.vocab_size * shape.d_model  # last position only
    return batch * (per_layer_matmuls + head)


def forward_flops(shape: Shape, batch: int, start: int, new: int) -> int:
    """FLOPs of one forward pass of `new` tokens at positions start.. over `start` cached tokens."""
    attention = attention_flops_per_pair(shape) * causal_pairs(start, new)
    return forward_matmul_flops(shape, batch, new) + batch * attention


def decode_step_flops(shape: Shape, batch: int, context: int, layout: Layout = CONTIGUOUS,
                      max_len: Optional[int] = None) -> int:
    """FLOPs of the decode step at `context` tokens before it (see the position conventions above).
    Cached: one token over the keys the layout scores it against; no cache (None): all c + 1 tokens."""
    if layout is None:
        return forward_flops(shape, batch, start=0, new=context + 1)
    keys = cache_terms.attended_keys(context, max_len or context + 1, layout)
    return forward_flops(shape, batch, start=keys - 1, new=1) + batch * keys * cache_terms.scoring_flops_per_key(shape, layout)


def decode_step_tokens(context: int, layout: Layout) -> int:
    """Tokens one decode step runs through the weights: its one new token when cached; without a cache,
    all c + 1 tokens."""
    return 1 if layout is not None else context + 1


def prefill_flops(shape: Shape, batch: int, prompt: int) -> int:
    """FLOPs of the prompt's forward pass (the same with or without a cache)."""
    return forward_flops(shape, batch, start=0, new=prompt)


def _tetrahedral(m: int) -> int:
    """Sum of the first m triangular numbers, sum_{T=1..m} T(T+1)/2 = m(m+1)(m+2)/6."""
    return m * (m + 1) * (m + 2) // 6


def generate_flops(shape: Shape, batch: int, prompt: int, steps: int, layout: Layout = CONTIGUOUS) -> int:
    """FLOPs of the `steps` decode steps after a `prompt`-token prompt (prefill excluded), in closed form.

    Cached: linear in length (step i: 2 * matmul weights + one query over p + i + 1 keys, or over all
    p + steps positions for a layout that reads max_len, or at most its token budget + 1 keys, each
    scored by the layout's eviction score too). No cache: quadratic (step i: a forward pass over
    T = p + i + 1 tokens, T(T+1)/2 causal pairs).
    """
    layer_matmuls = 2 * (matmul_params(shape) - shape.vocab_size * shape.d_model)  # per token
    head = 2 * shape.vocab_size * shape.d_model  # per forward pass
    pair = attention_flops_per_pair(shape)
    first, last = prompt + 1, prompt + steps  # keys seen (cached) / tokens run (no cache) by the steps
    keys_or_tokens = (first + last) * steps // 2  # sum over the steps of T
    if layout is not None and layout.reads_max_len:
        per_sequence = steps * (layer_matmuls + head) + pair * steps * cache_terms.span(layout, prompt + steps)
    elif layout is not None:
        scored_pair = pair + cache_terms.scoring_flops_per_key(shape, layout)
        per_sequence = steps * (layer_matmuls + head) + scored_pair * cache_terms.summed_attended_keys(prompt, steps, layout)
    else:
        pairs = _tetrahedral(last) - _tetrahedral(first - 1)  # sum over the steps of T(T+1)/2
        per_sequence = layer_matmuls * keys_or_tokens + steps * head + pair * pairs
    return batch * per_sequence


# --- Bytes beyond a decode step --------------------------------------------------------------------


def prefill_bytes(shape: Shape, dtype: str, batch: int, prompt: int, layout: Layout = CONTIGUOUS) -> dict:
    """Bytes the prompt's forward pass must move: every weight once (all but the embedding table, plus
    the batch * prompt embedding rows it gathers) and, when cached, the prompt's cache entries written.
    Activations are not counted (they stay in cache or are the kernel's business)."""
    weights = (params(shape) - embedding_params(shape) + batch * prompt * shape.d_model) * dtype_bytes(dtype)
    cache_write = batch * prompt * kv_bytes_per_token(shape, dtype, layout) if layout is not None else 0
    return {"weights": weights, "cache_read": 0, "cache_write": cache_write, "total": weights + cache_write}


def prefill_bytes_per_token(shape: Shape, dtype: str, batch: int, prompt: int) -> float:
    """Prefill bytes per prompt token processed (batch * prompt tokens): about weights / (batch * p)."""
    return prefill_bytes(shape, dtype, batch, prompt)["total"] / (batch * prompt)


def decode_bytes_per_token(shape: Shape, dtype: str, batch: int, context: int, layout: Layout = CONTIGUOUS) -> float:
    """Cached decode bytes per generated token (one per sequence): weights + cache, shared by the batch."""
    return decode_step_bytes(shape, dtype, batch, context, layout)["total"] / batch


def tokens_to_match_weights(shape: Shape, dtype: str, layout: CacheLayout = CONTIGUOUS) -> float:
    """Cached tokens (batch * tokens, any split) whose K/V weigh as much as all the weights."""
    return weight_bytes(shape, dtype) / kv_bytes_per_token(shape, dtype, layout)


# --- Roofline ----------------------------------------------------------------------------------------


def decode_step_phases(shape: Shape, dtype: str, batch: int, context: int, layout: Layout = CONTIGUOUS,
                       max_len: Optional[int] = None) -> tuple[Phase, Phase]:
    """The step's two phases: the matmuls (their FLOPs, the weights' bytes), then attention (the rest
    of its FLOPs: QK^T, PV and an evicting layout's scoring; every cache byte)."""
    parts = decode_step_bytes(shape, dtype, batch, context, layout, max_len)
    matmul_flops = forward_matmul_flops(shape, batch, decode_step_tokens(context, layout))
    attention_flops = decode_step_flops(shape, batch, context, layout, max_len) - matmul_flops
    return Phase(matmul_flops, parts["weights"]), Phase(attention_flops, parts["total"] - parts["weights"])


def decode_step_time(shape: Shape, dtype: str, batch: int, context: int, roof: Roof, layout: Layout = CONTIGUOUS,
                     max_len: Optional[int] = None) -> float:
    """Roofline seconds of one decode step: each phase at its own roof, summed."""
    return phased_time(decode_step_phases(shape, dtype, batch, context, layout, max_len), roof)


@dataclass(frozen=True)
class MeanStep:
    """A point's decode steps per the model, averaged over its timed steps (ctx .. ctx + steps - 1)."""

    bytes: float  # bytes moved per step
    flops: float  # FLOPs per step
    seconds: Optional[float]  # roofline seconds per step (each step's phases at their roofs); None without a roof
    phases: tuple[Phase, Phase]  # the mean step's matmuls and attention (decode_step_phases), summing to the above


def mean_decode_step(shape: Shape, dtype: str, batch: int, ctx: int, steps: int, layout: Layout = CONTIGUOUS,
                     roof: Optional[Roof] = None) -> MeanStep:
    """The one place a point's analytic step is computed: the row, results.load, the report and the
    tests all call this. Bytes and FLOPs are exact means in closed form; the time is each step's
    roofline time summed (a compute-bound step cannot lend idle bandwidth to the next) in closed form.
    A preallocated cache spans ctx + steps tokens."""
    # a step's matmul FLOPs are a line in its index (constant when cached), so their mean is the ends' mean
    ends = (forward_matmul_flops(shape, batch, decode_step_tokens(c, layout)) for c in (ctx, ctx + steps - 1))
    matmul_flops, weights = sum(ends) / 2, decode_weight_bytes(shape, dtype, batch)
    flops = generate_flops(shape, batch, ctx, steps, layout) / steps
    summed_bytes = 0.0
    for first, count in _budget_pieces(ctx, steps, layout):
        first_bytes, per_step = _step_bytes_line(shape, dtype, batch, first, count, layout)
        summed_bytes += count * (first_bytes + per_step * (count - 1) / 2)
    mean_bytes = summed_bytes / steps
    seconds = None if roof is None else generate_time(shape, dtype, batch, ctx, steps, roof, layout) / steps
    phases = Phase(matmul_flops, weights), Phase(flops - matmul_flops, mean_bytes - weights)
    return MeanStep(bytes=mean_bytes, flops=flops, seconds=seconds, phases=phases)


def _budget_pieces(prompt: int, steps: int, layout: Layout) -> list[tuple[int, int]]:
    """(first context, steps) runs of steps on which a step's bytes are one line and its FLOPs one
    polynomial: all the steps, or split where the cache fills its token budget (growing, then flat)."""
    budget = layout.token_budget if layout is not None else 0
    if prompt < budget < prompt + steps:
        return [(prompt, budget - prompt), (budget, prompt + steps - budget)]
    return [(prompt, steps)]


def _step_bytes_line(shape: Shape, dtype: str, batch: int, prompt: int, steps: int, layout: Layout) -> tuple[float, float]:
    """(bytes of the first step, growth per step): a step's bytes are linear in its context, except
    for a quantized layout's residual, whose full-width tokens rise and fall as blocks fill;
    that sawtooth enters as its exact mean over the steps (so a time sum is exact unless the steps
    cross the ridge within one window cycle)."""
    max_len = prompt + steps
    if layout is not None and layout.residual_tokens:
        plain = dataclasses.replace(layout, residual_tokens=0)
        full = cache_terms.full_width_bytes_per_token(shape, dtype, layout)
        extra_per_token = full - cache_terms.stored_bytes_per_token(shape, dtype, plain)
        window = cache_terms.mean_window_tokens(layout, prompt, steps) + 1  # + the token written to the window
        first, second = (decode_step_bytes(shape, dtype, batch, prompt + i, plain, max_len)["total"] for i in (0, 1))
        return first + batch * window * extra_per_token, second - first
    first, second = (decode_step_bytes(shape, dtype, batch, prompt + i, layout, max_len)["total"] for i in (0, 1))
    return first, second - first


def generate_time(shape: Shape, dtype: str, batch: int, prompt: int, steps: int, roof: Roof,
                  layout: Layout = CONTIGUOUS) -> float:
    """Roofline seconds of the `steps` decode steps: each step at its own roof, then summed (a step that
    is compute bound cannot lend its idle bandwidth to the next). Closed form: a step's FLOPs are a
    polynomial of degree <= 2 in its index and its bytes a line (on each side of the step where a token
    budget fills), so the sum of their maximum splits at the crossings."""
    return sum(_piece_time(shape, dtype, batch, first, count, roof, layout)
               for first, count in _budget_pieces(prompt, steps, layout))


def _piece_time(shape: Shape, dtype: str, batch: int, prompt: int, steps: int, roof: Roof, layout: Layout) -> float:
    """The steps' summed roofline time, phase by phase (decode_step_phases): the matmuls' FLOPs are a
    line in the step's index and their bytes (the weights) constant; attention's FLOPs a polynomial of
    degree <= 2 and its bytes a line."""
    max_len = prompt + steps

    def matmul_flops(i: int) -> float:
        return forward_matmul_flops(shape, batch, decode_step_tokens(prompt + i, layout))

    def attention_flops(i: int) -> float:
        return decode_step_flops(shape, batch, prompt + i, layout, max_len) - matmul_flops(i)

    f0, f1, f2 = attention_flops(0), attention_flops(1), attention_flops(2)
    a2 = (f2 - 2 * f1 + f0) / 2
    a1 = f1 - f0 - a2
    weights = decode_weight_bytes(shape, dtype, batch)
    b0, b1 = _step_bytes_line(shape, dtype, batch, prompt, steps, layout)
    per_flop, per_byte = 1 / roof.flops_per_s, 1 / roof.bytes_per_s
    m0, m1 = matmul_flops(0), matmul_flops(1)
    matmuls = summed_max(m0 * per_flop, (m1 - m0) * per_flop, 0.0, weights * per_byte, 0.0, steps)
    attention = summed_max(f0 * per_flop, a1 * per_flop, a2 * per_flop, (b0 - weights) * per_byte, b1 * per_byte, steps)
    return matmuls + attention


def prefill_phases(shape: Shape, dtype: str, batch: int, prompt: int, layout: Layout = CONTIGUOUS) -> tuple[Phase, Phase]:
    """The prompt's forward pass in two phases: its matmuls with the weights, then its attention and the
    cache entries it writes."""
    parts = prefill_bytes(shape, dtype, batch, prompt, layout)
    matmul_flops = forward_matmul_flops(shape, batch, prompt)
    return (Phase(matmul_flops, parts["weights"]),
            Phase(prefill_flops(shape, batch, prompt) - matmul_flops, parts["total"] - parts["weights"]))


def prefill_time(shape: Shape, dtype: str, batch: int, prompt: int, roof: Roof, layout: Layout = CONTIGUOUS) -> float:
    """Roofline seconds of the prompt's forward pass, each phase at its own roof."""
    return phased_time(prefill_phases(shape, dtype, batch, prompt, layout), roof)


def summary(shape: Shape, dtype: str, batch: int, ctx: int, decode_tokens: int, roof: Roof,
            layout: Layout = CONTIGUOUS) -> dict:
    """Every figure of the analytic CLI for one point, the cached ones for `layout` (docs/analytic.md)."""
    max_len = ctx + decode_tokens
    step_bytes = decode_step_bytes(shape, dtype, batch, ctx, layout, max_len)["total"]
    step_flops = decode_step_flops(shape, batch, ctx, layout, max_len)
    step_phases = decode_step_phases(shape, dtype, batch, ctx, layout, max_len)
    per_token = kv_bytes_per_token(shape, dtype, layout) if layout is not None else 0  # no cache: nothing per token
    return {
        "params": params(shape),
        "weight_bytes": weight_bytes(shape, dtype),
        "kv_bytes_per_token": per_token,
        "kv_cache_bytes": kv_cache_bytes(shape, dtype, batch, max_len, layout),
        "tokens_to_match_weights": weight_bytes(shape, dtype) / per_token if per_token else None,
        "flops_decode_step": step_flops,
        "flops_decode_step_no_cache": decode_step_flops(shape, batch, ctx, None),
        "flops_generate_cached": generate_flops(shape, batch, ctx, decode_tokens, layout),
        "flops_generate_no_cache": generate_flops(shape, batch, ctx, decode_tokens, None),
        "flops_prefill": prefill_flops(shape, batch, ctx),
        "bytes_decode_step": step_bytes,
        "bytes_decode_step_no_cache": decode_step_bytes(shape, dtype, batch, ctx, None)["total"],
        "decode_step_s": phased_time(step_phases, roof),
        "decode_step_bound": phased_bound(step_phases, roof),
        "generate_s_cached": generate_time(shape, dtype, batch, ctx, decode_tokens, roof, layout),
        "generate_s_no_cache": generate_time(shape, dtype, batch, ctx, decode_tokens, roof, None),
        "prefill_s": prefill_time(shape, dtype, batch, ctx, roof, layout),
        "prefill_bytes_per_token": prefill_bytes_per_token(shape, dtype, batch, ctx),
        "decode_bytes_per_token": step_bytes / batch,
        "ridge_flops_per_byte": roof.ridge,
        "decode_intensity_flops_per_byte": intensity(step_flops, step_bytes),
        "peak_flops": roof.flops_per_s,
        "bandwidth_Bps": roof.bytes_per_s,
    }

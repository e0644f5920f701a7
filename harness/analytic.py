"""Analytic model of a Llama-3-style decoder: parameters, bytes and FLOPs. Pure functions, no torch.

Conventions (one each, used everywhere in the harness):
- Parameters count every weight: embedding, per-layer attention (wq, wk, wv, wo) and SwiGLU MLP
  (w1, w2, w3), both RMSNorm weights per layer, the final norm and the untied output head.
- A decode step reads every weight except the embedding table, of which it reads only the rows of the
  tokens it embeds (batch rows). The embedding lookup is a gather, not a matmul: it costs no FLOPs.
- Bytes count weights and K/V cache entries only; activations are not counted.
- FLOPs: 2 per multiply-add, matmuls and attention's QK^T/PV only; see the FLOPs section below for the
  exact list and for how positions are numbered (decode step i of a p-token prompt sits at context p+i).
- Roofline time of a step = max(FLOPs / peak FLOP/s, bytes / bandwidth); totals sum per-step times.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

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


def kv_bytes_per_token(shape: Shape, dtype: str) -> int:
    """Cache bytes per token: one key and one value vector per layer and KV head."""
    return 2 * shape.n_layers * shape.n_kv_heads * shape.resolved_head_dim * dtype_bytes(dtype)


def kv_cache_bytes(shape: Shape, dtype: str, batch: int, tokens: int) -> int:
    """Cache bytes for `batch` sequences of `tokens` tokens: only batch * tokens matters."""
    return batch * tokens * kv_bytes_per_token(shape, dtype)


def decode_step_bytes(shape: Shape, dtype: str, batch: int, context: int, cached: bool = True) -> dict:
    """Bytes one decode step must move, by part.

    With a cache, the step at `context` cached tokens reads the weights and the whole cache and writes
    one new K/V entry per sequence. Without a cache, it re-reads the weights once (the prefix is
    recomputed in one pass) and moves no cache; activations are not counted in either case.
    """
    weights = decode_weight_bytes(shape, dtype, batch)
    cache_read = kv_cache_bytes(shape, dtype, batch, context) if cached else 0
    cache_write = kv_cache_bytes(shape, dtype, batch, 1) if cached else 0
    return {
        "weights": weights,
        "cache_read": cache_read,
        "cache_write": cache_write,
        "total": weights + cache_read + cache_write,
    }


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


def forward_flops(shape: Shape, batch: int, start: int, new: int) -> int:
    """FLOPs of one forward pass of `new` tokens at positions start.. over `start` cached tokens."""
    per_layer_matmuls = 2 * new * (matmul_params(shape) - shape.vocab_size * shape.d_model)
    head = 2 * shape.vocab_size * shape.d_model  # last position only
    attention = attention_flops_per_pair(shape) * causal_pairs(start, new)
    return batch * (per_layer_matmuls + head + attention)


def decode_step_flops(shape: Shape, batch: int, context: int, cached: bool = True) -> int:
    """FLOPs of the decode step at `context` tokens before it (see the position conventions above)."""
    if cached:
        return forward_flops(shape, batch, start=context, new=1)
    return forward_flops(shape, batch, start=0, new=context + 1)


def prefill_flops(shape: Shape, batch: int, prompt: int) -> int:
    """FLOPs of the prompt's forward pass (the same with or without a cache)."""
    return forward_flops(shape, batch, start=0, new=prompt)


def _tetrahedral(m: int) -> int:
    """Sum of the first m triangular numbers, sum_{T=1..m} T(T+1)/2 = m(m+1)(m+2)/6."""
    return m * (m + 1) * (m + 2) // 6


def generate_flops(shape: Shape, batch: int, prompt: int, steps: int, cached: bool = True) -> int:
    """FLOPs of the `steps` decode steps after a `prompt`-token prompt (prefill excluded), summed exactly.

    Cached: linear in length (step i: 2 * matmul weights + one query over p + i + 1 keys).
    No cache: quadratic (step i: a forward pass over T = p + i + 1 tokens, T(T+1)/2 causal pairs).
    """
    layer_matmuls = 2 * (matmul_params(shape) - shape.vocab_size * shape.d_model)  # per token
    head = 2 * shape.vocab_size * shape.d_model  # per forward pass
    pair = attention_flops_per_pair(shape)
    first, last = prompt + 1, prompt + steps  # keys seen (cached) / tokens run (no cache) by the steps
    keys_or_tokens = (first + last) * steps // 2  # sum over the steps of T
    if cached:
        per_sequence = steps * (layer_matmuls + head) + pair * keys_or_tokens
    else:
        pairs = _tetrahedral(last) - _tetrahedral(first - 1)  # sum over the steps of T(T+1)/2
        per_sequence = layer_matmuls * keys_or_tokens + steps * head + pair * pairs
    return batch * per_sequence


# --- Bytes beyond a decode step --------------------------------------------------------------------


def prefill_bytes(shape: Shape, dtype: str, batch: int, prompt: int, cached: bool = True) -> dict:
    """Bytes the prompt's forward pass must move: every weight once (all but the embedding table, plus
    the batch * prompt embedding rows it gathers) and, when cached, the prompt's cache entries written.
    Activations are not counted (they stay in cache or are the kernel's business)."""
    weights = (params(shape) - embedding_params(shape) + batch * prompt * shape.d_model) * dtype_bytes(dtype)
    cache_write = kv_cache_bytes(shape, dtype, batch, prompt) if cached else 0
    return {"weights": weights, "cache_read": 0, "cache_write": cache_write, "total": weights + cache_write}


def prefill_bytes_per_token(shape: Shape, dtype: str, batch: int, prompt: int) -> float:
    """Prefill bytes per prompt token processed (batch * prompt tokens): about weights / (batch * p)."""
    return prefill_bytes(shape, dtype, batch, prompt)["total"] / (batch * prompt)


def decode_bytes_per_token(shape: Shape, dtype: str, batch: int, context: int) -> float:
    """Cached decode bytes per generated token (one per sequence): weights + cache, shared by the batch."""
    return decode_step_bytes(shape, dtype, batch, context)["total"] / batch


def tokens_to_match_weights(shape: Shape, dtype: str) -> float:
    """Cached tokens (batch * tokens, any split) whose K/V weigh as much as all the weights.
    Independent of dtype when weights and cache share it; the argument is kept for mixed futures."""
    return weight_bytes(shape, dtype) / kv_bytes_per_token(shape, dtype)


# --- Roofline ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Roof:
    """The two ceilings of a device for one dtype."""

    flops_per_s: float  # peak dense matmul FLOP/s in this dtype
    bytes_per_s: float  # memory read bandwidth, bytes/s

    @property
    def ridge(self) -> float:
        """FLOPs per byte above which a kernel is compute bound (peak FLOP/s / bandwidth)."""
        return self.flops_per_s / self.bytes_per_s


def intensity(flops: float, bytes_moved: float) -> float:
    """Arithmetic intensity, FLOPs per byte moved."""
    return flops / bytes_moved


def ridge_point(roof: Roof) -> float:
    return roof.ridge


def roofline_time(flops: float, bytes_moved: float, roof: Roof) -> float:
    """Seconds at the roof: max(FLOPs / peak FLOP/s, bytes / bandwidth). A lower bound, never a forecast
    of overheads (launches, Python, cache misses beyond the byte count)."""
    return max(flops / roof.flops_per_s, bytes_moved / roof.bytes_per_s)


def bound(flops: float, bytes_moved: float, roof: Roof) -> str:
    """'memory' when the bytes take longer than the FLOPs at the roof, else 'compute'."""
    return "memory" if bytes_moved / roof.bytes_per_s >= flops / roof.flops_per_s else "compute"


def decode_step_time(shape: Shape, dtype: str, batch: int, context: int, roof: Roof, cached: bool = True) -> float:
    flops = decode_step_flops(shape, batch, context, cached)
    return roofline_time(flops, decode_step_bytes(shape, dtype, batch, context, cached)["total"], roof)


def generate_time(shape: Shape, dtype: str, batch: int, prompt: int, steps: int, roof: Roof, cached: bool = True) -> float:
    """Roofline seconds of the `steps` decode steps: each step at its own roof, then summed (a step that
    is compute bound cannot lend its idle bandwidth to the next)."""
    return sum(decode_step_time(shape, dtype, batch, prompt + i, roof, cached) for i in range(steps))


def prefill_time(shape: Shape, dtype: str, batch: int, prompt: int, roof: Roof, cached: bool = True) -> float:
    flops = prefill_flops(shape, batch, prompt)
    return roofline_time(flops, prefill_bytes(shape, dtype, batch, prompt, cached)["total"], roof)


def summary(shape: Shape, dtype: str, batch: int, ctx: int, decode_tokens: int, roof: Roof) -> dict:
    """Every figure of the analytic CLI for one workload (units in docs/analytic_and_report.md)."""
    step_bytes = decode_step_bytes(shape, dtype, batch, ctx)["total"]
    step_flops = decode_step_flops(shape, batch, ctx)
    return {
        "params": params(shape),
        "weight_bytes": weight_bytes(shape, dtype),
        "kv_bytes_per_token": kv_bytes_per_token(shape, dtype),
        "kv_cache_bytes": kv_cache_bytes(shape, dtype, batch, ctx + decode_tokens),
        "tokens_to_match_weights": tokens_to_match_weights(shape, dtype),
        "flops_decode_step": step_flops,
        "flops_decode_step_no_cache": decode_step_flops(shape, batch, ctx, cached=False),
        "flops_generate_cached": generate_flops(shape, batch, ctx, decode_tokens, cached=True),
        "flops_generate_no_cache": generate_flops(shape, batch, ctx, decode_tokens, cached=False),
        "flops_prefill": prefill_flops(shape, batch, ctx),
        "bytes_decode_step": step_bytes,
        "bytes_decode_step_no_cache": decode_step_bytes(shape, dtype, batch, ctx, cached=False)["total"],
        "decode_step_s": roofline_time(step_flops, step_bytes, roof),
        "decode_step_bound": bound(step_flops, step_bytes, roof),
        "generate_s_cached": generate_time(shape, dtype, batch, ctx, decode_tokens, roof, cached=True),
        "generate_s_no_cache": generate_time(shape, dtype, batch, ctx, decode_tokens, roof, cached=False),
        "prefill_s": prefill_time(shape, dtype, batch, ctx, roof),
        "prefill_bytes_per_token": prefill_bytes_per_token(shape, dtype, batch, ctx),
        "decode_bytes_per_token": decode_bytes_per_token(shape, dtype, batch, ctx),
        "ridge_flops_per_byte": roof.ridge,
        "decode_intensity_flops_per_byte": intensity(step_flops, step_bytes),
        "peak_flops": roof.flops_per_s,
        "bandwidth_Bps": roof.bytes_per_s,
    }


if __name__ == "__main__":  # `python -m harness.analytic key=value ...`: see harness.analytic_cli
    import sys

    from harness.analytic_cli import main

    sys.exit(main(sys.argv[1:]))

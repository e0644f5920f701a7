"""Analytic model of a Llama-3-style decoder: parameters, bytes and FLOPs. Pure functions, no torch.

Conventions (one each, used everywhere in the harness):
- Parameters count every weight: embedding, per-layer attention (wq, wk, wv, wo) and SwiGLU MLP
  (w1, w2, w3), both RMSNorm weights per layer, the final norm and the untied output head.
- A decode step reads every weight except the embedding table, of which it reads only the rows of the
  tokens it embeds (batch rows). The embedding lookup is a gather, not a matmul: it costs no FLOPs.
"""
from __future__ import annotations

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

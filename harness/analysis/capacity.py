"""Capacity planning: how many sequences fit on a device, or on a node of `tp` devices, at a context.

Tensor parallelism over `tp` devices (as serving engines shard Llama): the attention heads, the MLP
and the vocabulary (embedding and output head) are split `tp` ways; the KV heads are split too while
there are enough of them, and replicated once `tp` exceeds n_kv_heads (each device then keeps one KV
head, shared by its query heads), so the cache per device stops shrinking there. RMSNorm weights are
replicated. A device holds its weights, its share of every sequence's cache, and a reserve for
activations and workspace (a fraction of its memory, stated with every answer). Pure: no torch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from harness.analysis import analytic
from harness.analysis.cache_terms import Shape, dtype_bytes
from harness.config.layout import CONTIGUOUS, CacheLayout

DEFAULT_RESERVE = 0.10  # share of device memory kept for activations, workspace and fragmentation


def check_tp(shape: Shape, tp: int) -> Optional[str]:
    """Why `tp` devices cannot split this shape, or None: tp must divide the query heads, and the KV
    heads must be split evenly (tp divides n_kv) or replicated evenly (n_kv divides tp)."""
    if tp < 1:
        return f"must be a positive integer, got {tp}"
    if shape.n_heads % tp:
        return f"{tp} does not divide model.n_heads={shape.n_heads}"
    if shape.n_kv_heads % tp and tp % shape.n_kv_heads:
        return f"{tp} neither divides nor is a multiple of model.n_kv_heads={shape.n_kv_heads}"
    return None


def kv_heads_per_device(shape: Shape, tp: int) -> int:
    """KV heads each device stores: n_kv / tp, or 1 once tp > n_kv (replicated)."""
    return max(shape.n_kv_heads // tp, 1)


def weight_bytes_per_device(shape: Shape, dtype: str, tp: int) -> float:
    """Weights one device holds: its split of every matrix (the K/V projections replicated with their
    heads), the norms whole."""
    d, hd, elem = shape.d_model, shape.resolved_head_dim, dtype_bytes(dtype)
    q_and_o = 2 * d * shape.n_heads * hd / tp
    k_and_v = 2 * d * kv_heads_per_device(shape, tp) * hd
    mlp = 3 * d * shape.ffn_dim / tp
    norms = 2 * d
    vocabulary = 2 * shape.vocab_size * d / tp  # embedding and untied output head, split by rows
    return (shape.n_layers * (q_and_o + k_and_v + mlp + norms) + d + vocabulary) * elem


def kv_bytes_per_token_per_device(shape: Shape, dtype: str, tp: int, layout: CacheLayout = CONTIGUOUS) -> float:
    """One token's cache on one device: the layout's bytes per token for its share of the KV heads."""
    return analytic.kv_bytes_per_token(shape, dtype, layout) * kv_heads_per_device(shape, tp) / shape.n_kv_heads


@dataclass(frozen=True)
class Capacity:
    """What fits on each of `tp` devices of `device_memory_bytes`."""

    tp: int  # devices the model is split over
    device_memory_bytes: float  # memory of one device
    reserve_bytes: float  # kept back per device for activations and workspace
    weight_bytes: float  # weights per device
    kv_bytes_per_token: float  # cache per token per device
    cache_room_bytes: float  # what is left per device for the cache (negative: the weights do not fit)

    @property
    def weights_fit(self) -> bool:
        return self.cache_room_bytes >= 0

    @property
    def max_tokens(self) -> int:
        """Largest batch x tokens the devices hold together (any split of the product)."""
        return max(int(self.cache_room_bytes // self.kv_bytes_per_token), 0)

    def max_batch(self, context: int) -> int:
        """Most sequences of `context` tokens that fit."""
        return self.max_tokens // context

    def max_context(self, batch: int) -> int:
        """Longest context at which `batch` sequences fit (0: not even one token each)."""
        return self.max_tokens // batch

    def fits(self, batch: int, context: int) -> bool:
        return self.weights_fit and batch * context <= self.max_tokens


def capacity(shape: Shape, dtype: str, device_memory_bytes: float, tp: int = 1, layout: CacheLayout = CONTIGUOUS,
             reserve: float = DEFAULT_RESERVE) -> Capacity:
    reserve_bytes = reserve * device_memory_bytes
    weights = weight_bytes_per_device(shape, dtype, tp)
    return Capacity(tp=tp, device_memory_bytes=device_memory_bytes, reserve_bytes=reserve_bytes, weight_bytes=weights,
                    kv_bytes_per_token=kv_bytes_per_token_per_device(shape, dtype, tp, layout),
                    cache_room_bytes=device_memory_bytes - reserve_bytes - weights)


def usd_per_million_tokens(step_seconds: float, batch: int, devices: int, usd_per_device_hour: float) -> float:
    """What generating a million tokens costs at `step_seconds` per decode step of `batch` sequences on
    `devices` devices rented at `usd_per_device_hour` each."""
    seconds_per_token = step_seconds / batch
    return usd_per_device_hour * devices / 3600 * seconds_per_token * 1e6

"""Capacity planning: what one device holds when a model is split over `tp` devices, how long its share
of the work takes at the roof, what fits at a context, and what the generated tokens cost.

Tensor parallelism over `tp` devices (as serving engines shard Llama): the attention heads, the MLP
and the vocabulary (embedding and output head) are split `tp` ways; the KV heads are split too while
there are enough of them, and replicated once `tp` exceeds n_kv_heads (each device then keeps one KV
head, shared by its query heads), so the cache per device stops shrinking there. RMSNorm weights are
replicated. A split that does not divide the MLP or the vocabulary evenly is charged at its largest
shard (rounded up), since that device sets both the memory needed and the time. A device holds its
weights, its share of every sequence's cache, and a reserve for activations and workspace (a fraction
of its memory, stated with every answer).

What the split's roofline time models, and what it does not: each device runs its share of every
matmul and of attention (its query heads over its KV heads, which it projects itself when they are
replicated) and reads its share of the weights and of the cache, all devices in lock step at their
own roof; a step takes the time of one device's share (`split_summary`). Not modelled: the two
all-reduces per layer (after attention's output projection and after the MLP) and the gather of the
logits, neither their link bandwidth nor their latency; the embedding gather is charged as if one
device read all `batch` rows. So for tp > 1 the time is a lower bound that ignores communication, as
every roofline time of the analytic model ignores what it does not count. Pure: no torch.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from harness.analysis import analytic
from harness.analysis.cache_terms import Shape
from harness.config.layout import CONTIGUOUS, CacheLayout

DEFAULT_RESERVE = 0.10  # share of device memory kept for activations, workspace and fragmentation
PLANNING_BATCHES = (1, 32, 128)  # batches a plan says the longest context for: one user, a small and a large serving batch
SECONDS_PER_HOUR = 3600

# The figures of analytic.summary that a split changes: the times and what bounds them are one
# device's share (sizes and work stay the whole model's, so they read the same at any tp).
SPLIT_KEYS = ("decode_step_s", "decode_step_bound", "generate_s_cached", "generate_s_no_cache", "prefill_s",
              "decode_intensity_flops_per_byte")


def check_tp(shape: Shape, tp: int) -> Optional[str]:
    """Why `tp` devices cannot split this shape, or None: tp must divide the query heads, and the KV
    heads must be split evenly (tp divides n_kv) or replicated evenly (n_kv divides tp)."""
    if tp < 1:
        why = f"must be a positive integer, got {tp}"
    elif shape.n_heads % tp:
        why = f"{tp} does not divide model.n_heads={shape.n_heads}"
    elif shape.n_kv_heads % tp and tp % shape.n_kv_heads:
        why = f"{tp} neither divides nor is a multiple of model.n_kv_heads={shape.n_kv_heads}"
    else:
        return None
    return f"{why}; allowed: {', '.join(map(str, allowed_tp(shape)))}"


def allowed_tp(shape: Shape) -> list[int]:
    """Every split check_tp accepts: the divisors of n_heads that divide or are multiples of n_kv_heads
    (found by trial up to the square root: milliseconds for any head count a shape may have)."""
    n = shape.n_heads
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    divisors = sorted({*small, *(n // d for d in small)})
    return [d for d in divisors if shape.n_kv_heads % d == 0 or d % shape.n_kv_heads == 0]


def kv_heads_per_device(shape: Shape, tp: int) -> int:
    """KV heads each device stores: n_kv / tp, or 1 once tp > n_kv (replicated)."""
    return max(shape.n_kv_heads // tp, 1)


@dataclass(frozen=True)
class DeviceShape:
    """One device's share of a decoder shape split over tp devices. It has the fields the analytic
    model reads (cache_terms.Shape), so analytic's functions applied to it give that device's
    parameters, bytes and FLOPs: no second copy of those formulas here."""

    name: str  # the whole model's preset name
    vocab_size: int  # its rows of the embedding and columns of the output head: vocab / tp, rounded up
    d_model: int  # whole: every device carries the full residual stream
    n_layers: int  # whole: every device runs every layer
    n_heads: int  # its query heads: n_heads / tp
    n_kv_heads: int  # its KV heads: n_kv / tp, or 1 once replicated
    ffn_dim: int  # its columns of the SwiGLU MLP: ffn_dim / tp, rounded up
    resolved_head_dim: int  # whole: heads are split, never cut


def device_shape(shape: Shape, tp: int) -> DeviceShape:
    return DeviceShape(name=getattr(shape, "name", "model"), vocab_size=-(-shape.vocab_size // tp),
                       d_model=shape.d_model, n_layers=shape.n_layers, n_heads=shape.n_heads // tp,
                       n_kv_heads=kv_heads_per_device(shape, tp), ffn_dim=-(-shape.ffn_dim // tp),
                       resolved_head_dim=shape.resolved_head_dim)


def weight_bytes_per_device(shape: Shape, dtype: str, tp: int) -> float:
    """Weights one device holds: its split of every matrix (the K/V projections replicated with their
    heads), the norms whole."""
    return analytic.weight_bytes(device_shape(shape, tp), dtype)


def kv_bytes_per_token_per_device(shape: Shape, dtype: str, tp: int,
                                  layout: Optional[CacheLayout] = CONTIGUOUS) -> float:
    """One token's cache on one device: the layout's bytes per token for its share of the KV heads
    (0 without a cache)."""
    return 0 if layout is None else analytic.kv_bytes_per_token(device_shape(shape, tp), dtype, layout)


def split_summary(shape: Shape, dtype: str, batch: int, ctx: int, decode_tokens: int, roof: analytic.Roof,
                  layout: Optional[CacheLayout] = CONTIGUOUS, tp: int = 1) -> dict:
    """analytic.summary for the model split over `tp` devices: sizes and work of the whole model, the
    times (SPLIT_KEYS) of one device's share at its own roof, and that share's first decode step.
    tp = 1 is analytic.summary itself. See the module docstring for what the split leaves out."""
    whole = analytic.summary(shape, dtype, batch, ctx, decode_tokens, roof, layout)
    share = whole if tp == 1 else analytic.summary(device_shape(shape, tp), dtype, batch, ctx, decode_tokens, roof,
                                                   layout)
    return {**whole, **{key: share[key] for key in SPLIT_KEYS},
            "flops_decode_step_per_device": share["flops_decode_step"],
            "bytes_decode_step_per_device": share["bytes_decode_step"]}


@dataclass(frozen=True)
class Capacity:
    """What fits on each of `tp` devices of `device_memory_bytes`."""

    tp: int  # devices the model is split over
    device_memory_bytes: float  # memory of one device
    reserve_bytes: float  # kept back per device for activations and workspace
    weight_bytes: float  # weights per device
    kv_bytes_per_token: float  # cache per token per device (0: no cache)
    cache_room_bytes: float  # what is left per device for the cache (negative: the weights do not fit)

    @property
    def weights_fit(self) -> bool:
        return self.cache_room_bytes >= 0

    @property
    def max_tokens(self) -> Optional[int]:
        """Largest batch x tokens the devices hold together (any split of the product); None without a
        cache, where nothing grows with the tokens."""
        if not self.kv_bytes_per_token:
            return None if self.weights_fit else 0
        return max(int(self.cache_room_bytes // self.kv_bytes_per_token), 0)

    def max_batch(self, context: int) -> Optional[int]:
        """Most sequences of `context` tokens that fit (None: any number, there is no cache)."""
        return None if self.max_tokens is None else self.max_tokens // context

    def max_context(self, batch: int) -> Optional[int]:
        """Longest context at which `batch` sequences fit (0: not even one token each; None: any)."""
        return None if self.max_tokens is None else self.max_tokens // batch

    def fits(self, batch: int, context: int) -> bool:
        return self.weights_fit and (self.max_tokens is None or batch * context <= self.max_tokens)


def capacity(shape: Shape, dtype: str, device_memory_bytes: float, tp: int = 1,
             layout: Optional[CacheLayout] = CONTIGUOUS, reserve: float = DEFAULT_RESERVE) -> Capacity:
    reserve_bytes = reserve * device_memory_bytes
    weights = weight_bytes_per_device(shape, dtype, tp)
    return Capacity(tp=tp, device_memory_bytes=device_memory_bytes, reserve_bytes=reserve_bytes, weight_bytes=weights,
                    kv_bytes_per_token=kv_bytes_per_token_per_device(shape, dtype, tp, layout),
                    cache_room_bytes=device_memory_bytes - reserve_bytes - weights)


def node_kv_budget_bytes(shape: Shape, dtype: str, device_memory_bytes: float, tp: int = 1,
                        reserve: float = DEFAULT_RESERVE) -> float:
    """The cache room of `tp` devices (Capacity.cache_room_bytes of each), in bytes of the whole
    model's cache: what a server's KV budget is when it counts a token's K and V over every KV head, as
    a strategy's own accounting does (strategies.serving.SequenceMemory). Each device holds its KV
    heads' share of every token, so a budget of B whole-model bytes takes B x kv_heads_per_device /
    n_kv_heads of each device: room x n_kv_heads / kv_heads_per_device (room x tp while tp divides
    n_kv_heads; replicated heads count once). Negative when the weights do not fit."""
    room = capacity(shape, dtype, device_memory_bytes, tp, CONTIGUOUS, reserve).cache_room_bytes
    return room * shape.n_kv_heads / kv_heads_per_device(shape, tp)


def capacity_figures(shape: Shape, dtype: str, layout: Optional[CacheLayout], tp: int, batch: int, tokens: int,
                     device_memory_bytes: Optional[float], reserve: float = DEFAULT_RESERVE) -> dict:
    """The capacity plan for `batch` sequences of `tokens` tokens (the cache at the end of a
    generation) on `tp` devices: per device, the weights and the cache, whether they fit with the
    reserve, and the largest batch and context that do. Without a device memory (a calibrated roof
    knows none) the answers that need one are None."""
    per_token = kv_bytes_per_token_per_device(shape, dtype, tp, layout)
    figures = {"weight_bytes_per_device": weight_bytes_per_device(shape, dtype, tp),
               "kv_bytes_per_token_per_device": per_token, "kv_cache_bytes_per_device": batch * tokens * per_token,
               "device_memory_bytes": device_memory_bytes}
    plan = None if device_memory_bytes is None else capacity(shape, dtype, device_memory_bytes, tp, layout, reserve)

    def known(answer):  # None where no device memory is known, rather than a guess
        return None if plan is None else answer(plan)

    figures.update({
        "reserve_bytes_per_device": known(lambda p: p.reserve_bytes),
        "fits": known(lambda p: p.fits(batch, tokens)),
        "max_tokens": known(lambda p: p.max_tokens),
        "max_batch": known(lambda p: p.max_batch(tokens)),
        "max_context": known(lambda p: p.max_context(batch)),
        **{f"max_context_batch_{b}": known(lambda p, b=b: p.max_context(b)) for b in PLANNING_BATCHES},
    })
    return figures


def decode_tokens_per_s(generate_seconds: float, batch: int, steps: int) -> float:
    """Generated tokens per second at the roof: `batch` sequences, one token each per decode step."""
    return batch * steps / generate_seconds


def usd_per_million_tokens(tokens_per_s: float, devices: int, usd_per_device_hour: float) -> float:
    """What generating a million tokens costs at `tokens_per_s` on `devices` devices rented at
    `usd_per_device_hour` each: the node's price per second over its tokens per second."""
    return usd_per_device_hour * devices / tokens_per_s * 1e6 / SECONDS_PER_HOUR


def cost_figures(generate_seconds: float, batch: int, steps: int, devices: int,
                 usd_per_device_hour: Optional[float]) -> dict:
    """Throughput of the cached decode at the roof, and its price per million tokens (None: no price)."""
    rate = decode_tokens_per_s(generate_seconds, batch, steps)
    price = None if usd_per_device_hour is None else usd_per_million_tokens(rate, devices, usd_per_device_hour)
    return {"decode_tokens_per_s": rate, "usd_per_million_tokens": price}

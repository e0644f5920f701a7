"""How a strategy stores its K/V, as far as the analytic model's byte counts need to know.

A strategy returns one `CacheLayout` (strategies.base.Strategy.cache_layout); the analytic model has
one function per term that reads it (harness.analysis.analytic), and every row records it in its
`cache_*` columns, so a row's prediction can be rebuilt from the row alone. Pure data: no torch.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from harness.config.keys import OPTIONAL_IN_KEY


@dataclass(frozen=True)
class CacheLayout:
    """Storage of one strategy's cache. The defaults describe a contiguous table in the compute dtype."""

    ROW_PREFIX: ClassVar[str] = "cache_"  # columns cache_block_size, cache_value_bits, ...

    block_size: int = 1  # each sequence is allocated whole blocks of this many tokens (paged); 1: exactly its tokens
    reads_max_len: bool = False  # attention reads every preallocated position each step, filled or not (static_full)
    copies_per_step: bool = False  # each step copies the whole cache into a new one (dynamic: torch.cat)
    value_bits: int = 0  # bits per stored K or V element; 0: the compute dtype's width
    scale_bytes_per_token: float = 0.0  # quantization scales per token and KV head, K and V together, in bytes
    residual_tokens: int = 0  # most recent tokens per sequence kept at the compute dtype's width (quantized)
    preallocated_tokens: int = 0  # positions allocated per sequence whatever its length; 0: exactly what the point needs
    # The compression axes besides bytes per number. Each is left out of a point's key at its default
    # (harness.config.keys), so the points of the strategies that existed before them keep their keys.
    # Most tokens kept per sequence, KV head and layer (eviction: the cache never holds more); 0: every token.
    token_budget: int = field(default=0, metadata=OPTIONAL_IN_KEY)
    # How the kept tokens are chosen: "" none; "recency" (streaming: sinks + recent window);
    # "accumulated_attention" (h2o); "observation_window" (snapkv, once at the end of prefill);
    # "current_attention" (tova). Scores read attention weights the step computes anyway.
    eviction_score: str = field(default="", metadata=OPTIONAL_IN_KEY)
    # Layers that store their own K/V (cross-layer sharing: the others read another layer's); 0: every layer.
    layers_stored: int = field(default=0, metadata=OPTIONAL_IN_KEY)
    # Key channels stored per KV head (ThinK's pruning; values keep every channel); 0: head_dim.
    key_channels_kept: int = field(default=0, metadata=OPTIONAL_IN_KEY)


CONTIGUOUS = CacheLayout()


def could_be_reference(exact: bool, layout: CacheLayout | None) -> bool:
    """The one rule for the exact cache that others are set against: a strategy proven exact (it generates
    the recompute reference's tokens) that stores its K/V in the plain contiguous layout, the one every
    other layout stores differently from. A group's step ratios and agreement checks are taken against
    such a member (harness.measure.group.reference_index, harness.measure.agreement), an approximate
    strategy's accuracy pass against such a strategy (harness.run.inputs.accuracy_reference), and the
    report reads the same rule from a row's `exact` and cache_* columns (harness.report.cohorts)."""
    return bool(exact) and layout == CONTIGUOUS

"""How a strategy stores its K/V, as far as the analytic model's byte counts need to know.

A strategy returns one `CacheLayout` (strategies.base.Strategy.cache_layout); the analytic model has
one function per term that reads it (harness.analysis.analytic), and every row records it in its
`cache_*` columns, so a row's prediction can be rebuilt from the row alone. Pure data: no torch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar


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


CONTIGUOUS = CacheLayout()

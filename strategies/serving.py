"""What a sequence costs a serving pool, as a strategy declares it: pure arithmetic, no torch.

A server holds a changing set of sequences, each at its own length, in one budget of KV bytes
(harness.serve). How much of the budget a sequence takes, and when it takes more, is the strategy's
own accounting, declared once per model shape as a `SequenceMemory`
(strategies.base.Strategy.sequence_memory) and read by the scheduler's allocator
(harness.serve.memory) and by a simulated run alike. The pool that holds the tensors
(strategies.caches.pools) allocates exactly what the declaration says, which a test checks per strategy.

- A reservation-based layout (`contiguous`, `quantized` without a window) takes prompt + max_tokens
  tokens when a request is admitted, as static servers do (FasterTransformer, Orca): one contiguous
  run of an arena, which can fragment.
- A paged layout takes a block of `block_tokens` tokens when a block fills (vLLM's PagedAttention).
- A growing layout (`dynamic`) takes exactly the tokens it holds.
- An evicting layout holds at most `kept_tokens` slots whatever the sequence's length.
The bytes per token count everything the layout stores per token: K and V of every layer and KV head,
quantization scales, an evicting cache's positions and scores.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

# Where a sequence's tokens sit in the pool (SequenceMemory.placement): how the allocator places it.
ARENA = "arena"  # one contiguous run of a shared table, taken whole at admission (a reservation)
BLOCKS = "blocks"  # blocks of a shared pool, taken one at a time, found through a block table
SEPARATE = "separate"  # tensors of its own, allocated when it is admitted (the allocator only counts bytes)
PLACEMENTS = (ARENA, BLOCKS, SEPARATE)


@dataclass(frozen=True)
class SequenceMemory:
    """One sequence's cost in a serving pool, in the strategy's own accounting."""

    bytes_per_token: int  # cache bytes of one token held: K and V of every layer and KV head, scales and positions included
    placement: str = SEPARATE  # ARENA, BLOCKS or SEPARATE: how the pool places it (module docstring)
    block_tokens: int = 1  # tokens taken at a time (paged: its block size); 1: exactly the tokens held
    reserved: bool = False  # takes its whole reservation (prompt + max_tokens) when it is admitted
    kept_tokens: Optional[int] = None  # most tokens it holds at once (an evicting cache's slots); None: every token
    sequence_bytes: int = 0  # bytes per sequence whatever its length (per-head state of an evicting cache)

    def __post_init__(self):
        if self.placement not in PLACEMENTS:
            raise ValueError(f"placement {self.placement!r} is not one of {', '.join(PLACEMENTS)}")
        if self.placement == ARENA and not self.reserved:
            raise ValueError("an arena run is taken whole at admission: an arena layout is a reserved one")
        if self.bytes_per_token < 1 or self.block_tokens < 1:
            raise ValueError("bytes_per_token and block_tokens must be positive")

    def tokens_taken(self, held: int, reserve: int) -> int:
        """Token positions a sequence holding `held` tokens, admitted to grow to `reserve`, takes."""
        tokens = max(held, reserve) if self.reserved else held
        if self.kept_tokens is not None:
            tokens = min(tokens, self.kept_tokens)
        return math.ceil(tokens / self.block_tokens) * self.block_tokens

    def taken_bytes(self, held: int, reserve: int) -> int:
        """Bytes of the budget such a sequence takes."""
        return self.tokens_taken(held, reserve) * self.bytes_per_token + self.sequence_bytes

    def holding_bytes(self, held: int) -> int:
        """Bytes of it that hold tokens: what the vLLM paper counts as used (the rest is reserved,
        rounded up to a block, or per-sequence state)."""
        kept = held if self.kept_tokens is None else min(held, self.kept_tokens)
        return kept * self.bytes_per_token


def kv_bytes_per_token(shape, dtype) -> int:
    """Bytes of K and V for one token in every layer and KV head, at the width of `dtype` (a torch dtype,
    or anything with an `itemsize`): the full-width caches' bytes per token."""
    return 2 * shape.n_layers * shape.n_kv_heads * shape.resolved_head_dim * dtype.itemsize

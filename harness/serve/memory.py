"""The KV budget of a serving run, and where each sequence sits in it: pure logic, no torch.

`KVMemory` admits, grows and frees sequences by the strategy's own accounting
(strategies.serving.SequenceMemory) within `serving.kv_budget_bytes`, and decides their placement,
which the pool that holds the tensors then realises (strategies.caches.pools): the allocator decides,
the pool follows, so the two can never disagree.

- ARENA (a reservation): the budget is one table of `budget // bytes_per_token` token rows; a
  sequence takes one contiguous run of its reservation, the first free run long enough (first fit),
  and gives it back whole. A request can wait while enough rows are free in total but no run is long
  enough: the external fragmentation of reservation-based servers.
- BLOCKS (paged): the budget is `budget // block_bytes` blocks, handed out from a free list (at first
  in a fixed shuffled order, so a kernel that ignored the block table would read other sequences'
  rows), one when a sequence's last block fills, all returned when it finishes or is preempted.
- SEPARATE: each sequence's tensors are its own; only their bytes are counted against the budget.
"""
from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass
from typing import Optional, Union

from strategies.serving import ARENA, BLOCKS, SequenceMemory

BLOCK_ORDER_SEED = 0x9A6ED  # the free list's first order (the step measurements' paged pool uses the same seed)


@dataclass(frozen=True)
class ArenaRun:
    """A sequence's rows of the arena: start .. start + tokens - 1."""

    start: int
    tokens: int


@dataclass(frozen=True)
class Blocks:
    """A sequence's blocks of the pool, in position order: position p is in ids[p // block_tokens]."""

    ids: tuple[int, ...]


Placement = Union[ArenaRun, Blocks, None]  # None: SEPARATE, tensors of its own


@dataclass
class _Held:
    tokens: int  # tokens it holds now
    reserve: int  # tokens it was admitted to grow to
    taken: int  # bytes of the budget it takes
    placement: Placement


class KVMemory:
    """Admission, growth and release of sequences within a budget of bytes (the module docstring)."""

    def __init__(self, layout: SequenceMemory, budget_bytes: int):
        self.layout, self.budget_bytes = layout, int(budget_bytes)
        self.sequences: dict[int, _Held] = {}
        self.taken_bytes = 0  # bytes of the budget the admitted sequences take
        if layout.placement == ARENA:
            self.capacity_tokens = self.budget_bytes // layout.bytes_per_token  # rows of the arena
            self.free_runs: list[tuple[int, int]] = [(0, self.capacity_tokens)] if self.capacity_tokens else []
        elif layout.placement == BLOCKS:
            self.block_bytes = layout.block_tokens * layout.bytes_per_token
            self.n_blocks = self.budget_bytes // self.block_bytes
            order = list(range(self.n_blocks))
            random.Random(BLOCK_ORDER_SEED).shuffle(order)
            self.free_blocks = deque(order)  # consumed from the front, returned to the back

    # -- what a request needs -------------------------------------------------------------------

    def fits_empty(self, tokens: int, reserve: int) -> bool:
        """Whether a sequence holding `tokens`, admitted to grow to `reserve`, fits the budget alone."""
        layout = self.layout
        if layout.placement == ARENA:
            return layout.tokens_taken(tokens, reserve) <= self.capacity_tokens
        if layout.placement == BLOCKS:
            return layout.tokens_taken(tokens, reserve) // layout.block_tokens <= self.n_blocks
        return layout.taken_bytes(tokens, reserve) <= self.budget_bytes

    # -- admission, growth, release ---------------------------------------------------------------

    def admit(self, seq: int, tokens: int, reserve: int) -> bool:
        """Place sequence `seq` holding `tokens` (to grow to `reserve`); False, and nothing taken, when
        the budget (or, for an arena, a long enough run) is not there."""
        if seq in self.sequences:
            raise ValueError(f"sequence {seq} is already admitted")
        layout = self.layout
        taken = layout.taken_bytes(tokens, reserve)
        placement: Placement = None
        if layout.placement == ARENA:
            placement = self._take_run(layout.tokens_taken(tokens, reserve))
            if placement is None:
                return False
        elif layout.placement == BLOCKS:
            count = layout.tokens_taken(tokens, reserve) // layout.block_tokens
            if count > len(self.free_blocks):
                return False
            placement = Blocks(tuple(self._take_blocks(count)))
        elif self.taken_bytes + taken > self.budget_bytes:
            return False
        self.sequences[seq] = _Held(tokens, reserve, taken, placement)
        self.taken_bytes += taken
        return True

    def grow(self, seq: int, tokens: int) -> bool:
        """Sequence `seq` now holds `tokens` (at least what it held): take what that needs; False, and
        nothing taken, when the budget does not hold it (the scheduler then preempts)."""
        held = self.sequences[seq]
        layout = self.layout
        taken = layout.taken_bytes(tokens, held.reserve)
        more = taken - held.taken
        if more > 0:
            if layout.placement == BLOCKS:
                count = more // self.block_bytes
                if count > len(self.free_blocks):
                    return False
                held.placement = Blocks(held.placement.ids + tuple(self._take_blocks(count)))
            elif layout.placement == ARENA:
                raise AssertionError("an arena sequence takes its whole reservation at admission")
            elif self.taken_bytes + more > self.budget_bytes:
                return False
            self.taken_bytes += more
            held.taken = taken
        held.tokens = tokens
        return True

    def free(self, seq: int) -> None:
        """Give back everything `seq` takes (it finished, or is preempted)."""
        held = self.sequences.pop(seq)
        self.taken_bytes -= held.taken
        if isinstance(held.placement, ArenaRun):
            self._return_run(held.placement)
        elif isinstance(held.placement, Blocks):
            self.free_blocks.extend(held.placement.ids)

    def placement(self, seq: int) -> Placement:
        return self.sequences[seq].placement

    @property
    def holding_bytes(self) -> int:
        """Bytes of the admitted sequences that hold tokens (strategies.serving.SequenceMemory.holding_bytes)."""
        return sum(self.layout.holding_bytes(held.tokens) for held in self.sequences.values())

    # -- the arena's runs and the pool's blocks ------------------------------------------------------

    def _take_run(self, tokens: int) -> Optional[ArenaRun]:
        for i, (start, length) in enumerate(self.free_runs):
            if length >= tokens:
                if length == tokens:
                    del self.free_runs[i]
                else:
                    self.free_runs[i] = (start + tokens, length - tokens)
                return ArenaRun(start, tokens)
        return None

    def _return_run(self, run: ArenaRun) -> None:
        """The run back among the free ones, merged with free neighbours (kept sorted by start)."""
        runs = sorted([*self.free_runs, (run.start, run.tokens)])
        merged: list[tuple[int, int]] = []
        for start, length in runs:
            if merged and merged[-1][0] + merged[-1][1] == start:
                merged[-1] = (merged[-1][0], merged[-1][1] + length)
            else:
                merged.append((start, length))
        self.free_runs = merged

    def _take_blocks(self, count: int) -> list[int]:
        return [self.free_blocks.popleft() for _ in range(count)]

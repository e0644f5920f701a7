"""The analytic model of one serving iteration: a ragged batch at a device's roofs. Pure: no torch.

An iteration of continuous batching (harness.serve.records.Iteration) decodes one token for each of
its decoding sequences, each at its own position, and computes prompt chunks. A serving engine runs
it as one forward pass over all its tokens (vLLM, Sarathi-Serve's chunked prefill), so:
- the weights are read once for the whole iteration, and its tokens' embedding rows gathered
  (analytic.decode_weight_bytes at as many rows as the iteration has tokens);
- each decode adds its own cache terms at its own position (analytic.decode_step_bytes less the
  weights, and analytic.decode_step_flops of one sequence: the layout's kept tokens, residual window,
  copies and eviction score enter as they do for a homogeneous step);
- each prompt chunk of `tokens` positions from `start` adds its forward pass (analytic.forward_flops
  of one sequence over the `start` tokens it follows), the cache of those `start` tokens read
  (cache_terms.read_bytes) and its own tokens' entries written (analytic.prefill_bytes' cache_write).
The time is the roofline time of its two phases, each at its own roof (harness.analysis.roofline): the
matmuls with the weights (every token's, the output head once per sequence) and attention over the
caches with the chunks' and decodes' cache bytes. Split
over `tp` devices, both are one device's share (harness.analysis.capacity.device_shape), which takes
the iteration's time, all devices in lock step; like every split time of the analytic model it leaves
out the all-reduces between devices and any launch or scheduling overhead: a lower bound.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

from harness.analysis import analytic, cache_terms
from harness.analysis.analytic import Layout, Phase, Roof
from harness.analysis.cache_terms import Shape
from harness.analysis.capacity import device_shape


@dataclass(frozen=True)
class Work:
    """What some part of an iteration computes and moves, by phase."""

    matmuls: Phase  # the matmuls with the weights: their FLOPs, the weights' bytes
    attention: Phase  # attention over the caches: its FLOPs, every cache byte read, written or copied

    @property
    def flops(self) -> float:
        return self.matmuls.flops + self.attention.flops

    @property
    def bytes(self) -> float:
        return self.matmuls.bytes + self.attention.bytes

    def __add__(self, other: "Work") -> "Work":
        return Work(self.matmuls + other.matmuls, self.attention + other.attention)


def decode_work(shape: Shape, dtype: str, position: int, layout: Layout) -> Work:
    """One sequence's decode at `position` tokens held, without the weights' bytes: its FLOPs by phase,
    and the cache bytes it reads, writes and copies."""
    matmuls, attention = analytic.decode_step_phases(shape, dtype, 1, position, layout)
    return Work(Phase(float(matmuls.flops), 0.0), Phase(float(attention.flops), float(attention.bytes)))


def chunk_work(shape: Shape, dtype: str, start: int, tokens: int, layout: Layout) -> Work:
    """One prompt chunk of `tokens` positions from `start`, without the weights' bytes: its forward pass
    over the `start` tokens before it, the cache of those read and its own entries written."""
    read = cache_terms.read_bytes(shape, dtype, 1, start, start + tokens, layout) if start else 0
    written = analytic.prefill_bytes(shape, dtype, 1, tokens, layout)["cache_write"]
    matmul_flops = analytic.forward_matmul_flops(shape, 1, tokens)
    attention_flops = analytic.forward_flops(shape, 1, start, tokens) - matmul_flops
    return Work(Phase(float(matmul_flops), 0.0), Phase(float(attention_flops), float(read + written)))


def weights_work(shape: Shape, dtype: str, tokens: int) -> Work:
    """The weights one forward pass over `tokens` tokens reads (all but the embedding table, and its
    tokens' rows of it)."""
    return Work(Phase(0.0, float(analytic.decode_weight_bytes(shape, dtype, tokens))), Phase(0.0, 0.0))


class IterationModel:
    """The analytic iterations of one model shape, dtype and cache layout on `tp` devices: one device's
    share of the work (the module docstring). A decode's terms depend on its position only, so they are
    computed once per position and reused by every iteration (a replay asks for the same positions
    many times)."""

    def __init__(self, shape: Shape, dtype: str, layout: Layout, tp: int = 1):
        self.shape = shape if tp == 1 else device_shape(shape, tp)
        self.dtype, self.layout, self.tp = dtype, layout, tp
        self._decodes: dict[int, Work] = {}

    def decode(self, position: int) -> Work:
        work = self._decodes.get(position)
        if work is None:
            work = self._decodes[position] = decode_work(self.shape, self.dtype, position, self.layout)
        return work

    def work(self, positions: Sequence[int], chunks: Iterable[tuple[int, int]]) -> Work:
        """The iteration's decodes at `positions` and its chunks as (start, tokens), in one pass."""
        chunks = list(chunks)
        tokens = len(positions) + sum(count for _, count in chunks)
        work = weights_work(self.shape, self.dtype, tokens)
        for position in positions:
            work = work + self.decode(position)
        for start, count in chunks:
            work = work + chunk_work(self.shape, self.dtype, start, count, self.layout)
        return work

    def seconds(self, positions: Sequence[int], chunks: Iterable[tuple[int, int]], roof: Roof) -> float:
        """Roofline seconds of the iteration (all devices in lock step: one share's time), phase by phase."""
        work = self.work(positions, chunks)
        return analytic.phased_time((work.matmuls, work.attention), roof)

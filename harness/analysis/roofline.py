"""The roofline: a device's two ceilings, and the time a piece of work takes at them. Pure: no torch.

A decode step (or a prefill, or a serving iteration) runs as a sequence of kernels in two phases that
do not overlap: the matmuls with the weights (projections, MLP, output head), then attention over the
cache. Each phase is bound by its own resource: at batch 16 the matmuls may already be compute-bound
while attention still waits on the cache's bytes. So a step's roofline time is the sum over its
phases of each phase's max(FLOPs / peak FLOP/s, bytes / bandwidth). One max over the whole step would
let the matmuls' arithmetic hide under the cache's reads, which a CPU or GPU running them one after
the other cannot do; the sum of the two terms over the whole step (no overlap at all, even inside one
kernel) would be an upper bound, not a ceiling. Where one phase dominates both its terms, the three
agree.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable


@dataclass(frozen=True)
class Roof:
    """The two ceilings of a device for one dtype."""

    flops_per_s: float  # peak dense matmul FLOP/s in this dtype
    bytes_per_s: float  # memory read bandwidth, bytes/s

    @property
    def ridge(self) -> float:
        """FLOPs per byte above which a kernel is compute bound (peak FLOP/s / bandwidth)."""
        return self.flops_per_s / self.bytes_per_s


@dataclass(frozen=True)
class Phase:
    """What one phase of a step computes and moves."""

    flops: float  # FLOPs of the phase
    bytes: float  # bytes it reads and writes

    def __add__(self, other: "Phase") -> "Phase":
        return Phase(self.flops + other.flops, self.bytes + other.bytes)


def intensity(flops: float, bytes_moved: float) -> float:
    """Arithmetic intensity, FLOPs per byte moved."""
    return flops / bytes_moved


def roofline_time(flops: float, bytes_moved: float, roof: Roof) -> float:
    """Seconds at the roof: max(FLOPs / peak FLOP/s, bytes / bandwidth). A lower bound, never a forecast
    of overheads (launches, Python, cache misses beyond the byte count)."""
    return max(flops / roof.flops_per_s, bytes_moved / roof.bytes_per_s)


def bound(flops: float, bytes_moved: float, roof: Roof) -> str:
    """'memory' when the bytes take longer than the FLOPs at the roof, else 'compute'."""
    return "memory" if bytes_moved / roof.bytes_per_s >= flops / roof.flops_per_s else "compute"


def phased_time(phases: Iterable[Phase], roof: Roof) -> float:
    """Seconds of phases run one after the other, each at the roof (the module docstring)."""
    return sum(roofline_time(phase.flops, phase.bytes, roof) for phase in phases)


def phased_bound(phases: Iterable[Phase], roof: Roof) -> str:
    """'memory' when the memory-bound phases take at least as long as the compute-bound ones at the
    roof, else 'compute': what the step as a whole waits on most."""
    waits = {"memory": 0.0, "compute": 0.0}
    for phase in phases:
        waits[bound(phase.flops, phase.bytes, roof)] += roofline_time(phase.flops, phase.bytes, roof)
    return "memory" if waits["memory"] >= waits["compute"] else "compute"


def _line_wins(c2: float, c1: float, c0: float, n: int) -> tuple[int, int]:
    """The integers [lo, hi) of 0..n-1 where c2 i^2 + c1 i + c0 < 0 (c2 >= 0: one interval at most)."""
    def clamp(i: float) -> int:
        return int(min(max(i, 0), n))

    if c2 == 0:
        if c1 == 0:
            return (0, n) if c0 < 0 else (0, 0)
        root = -c0 / c1
        return (0, clamp(math.ceil(root))) if c1 > 0 else (clamp(math.floor(root) + 1), n)
    disc = c1 * c1 - 4 * c2 * c0
    if disc <= 0:
        return 0, 0
    r1, r2 = (-c1 - math.sqrt(disc)) / (2 * c2), (-c1 + math.sqrt(disc)) / (2 * c2)
    lo, hi = clamp(math.floor(r1) + 1), clamp(math.ceil(r2))
    return (lo, hi) if hi > lo else (0, 0)


def summed_max(a0: float, a1: float, a2: float, b0: float, b1: float, n: int) -> float:
    """sum over i = 0..n-1 of max(a0 + a1 i + a2 i^2, b0 + b1 i) for a2 >= 0, in closed form."""
    def quadratic(lo: int, hi: int) -> float:  # sum over the integers lo..hi-1
        s1 = (hi * (hi - 1) - lo * (lo - 1)) / 2
        s2 = ((hi - 1) * hi * (2 * hi - 1) - (lo - 1) * lo * (2 * lo - 1)) / 6
        return a0 * (hi - lo) + a1 * s1 + a2 * s2

    def line(lo: int, hi: int) -> float:
        return b0 * (hi - lo) + b1 * (hi * (hi - 1) - lo * (lo - 1)) / 2

    lo, hi = _line_wins(a2, a1 - b1, a0 - b0, n)
    return quadratic(0, lo) + line(lo, hi) + quadratic(hi, n)

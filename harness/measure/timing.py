"""Timing one decode step at a time: CUDA events on a GPU, perf_counter on a CPU."""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch


class StepTimer:
    """Times a callable on `device`. On CUDA the region is bracketed by events and synchronised, so
    the time is the GPU's, not the launch's; on a CPU the ops are synchronous and perf_counter suffices.
    """

    def __init__(self, device: torch.device, cold_cache: bool = False):
        self.device = device
        # Evicting the cache outside the timed window makes every step read its bytes from DRAM
        # (triton's do_bench does the same with a 256 MB buffer on GPUs); 256 MiB is several times a
        # CPU's last-level cache.
        self.flush_buffer = torch.empty(64 * 2**20, dtype=torch.float32, device=device) if cold_cache else None
        clock = "CUDA events" if device.type == "cuda" else "perf_counter"
        self.method = clock + (", cache flushed before each step" if cold_cache else "")  # recorded in every row

    def time(self, fn: Callable[[], object]) -> tuple[object, float]:
        if self.flush_buffer is not None:
            self.flush_buffer.zero_()
        if self.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize(self.device)
            start.record()
            result = fn()
            end.record()
            end.synchronize()
            return result, start.elapsed_time(end) / 1e3
        begin = time.perf_counter()
        result = fn()
        return result, time.perf_counter() - begin


@dataclass
class StepStats:
    """Summary of per-step times (seconds)."""

    p10: float
    p50: float
    p90: float
    count: int

    @classmethod
    def of(cls, seconds: list[float]) -> "StepStats":
        if len(seconds) == 1:
            return cls(seconds[0], seconds[0], seconds[0], 1)
        deciles = statistics.quantiles(seconds, n=10, method="inclusive")
        return cls(deciles[0], statistics.median(seconds), deciles[-1], len(seconds))


def warm_up(step: Callable[[], float], min_steps: int, max_steps: int, tolerance: float) -> int:
    """Run `step` (which returns its own time) until two consecutive times agree within `tolerance`
    (relative) and at least `min_steps` ran, or `max_steps` ran. Returns the number of steps run.

    The first steps of a point pay for allocator growth, lazy initialisation and cold caches; stopping
    on agreement rather than after a fixed count keeps cheap points cheap and slow points honest.
    """
    previous = None
    for count in range(1, max_steps + 1):
        current = step()
        settled = previous is not None and abs(current - previous) <= tolerance * previous
        if count >= min_steps and settled:
            return count
        previous = current
    return max_steps

"""`search=max_batch` (`+sweep=capacity`): the largest batch that runs at a context within a memory limit.

The question a capacity plan answers on paper ("how many sequences fit in this much memory?"), asked of
the machine: each probe is a real point at one batch, measured and written as a row like any other,
and a batch *runs* when its row is ok and its measured peak (`peak_memory_bytes`: the point's own, on
a CPU the resident set above the process's start-up) stays within `memory_limit_bytes`. The search
starts at the memory model's answer, doubles while probes run and then bisects between the largest
batch that ran and the smallest that did not, so it needs about log2(batch) probes. The answer is set
beside the memory model's (harness.analysis.peak_memory: weights, cache and transients) and the
capacity plan's (harness.analysis.capacity: weights and cache within the limit, no reserve), so a user
sees how far each paper answer is from the machine.

Probes are checked against the machine's real free memory before they run, not against the limit: a
probe the model says will not fit is still measured, or the search could never find the model wrong.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Callable, Optional

import pandas as pd

from harness.analysis.capacity import capacity
from harness.analysis.peak_memory import predicted_peak_bytes
from harness.measure.memory import shortfall
from harness.store.files import finished_row

log = logging.getLogger("harness")

MAX_BATCH = 1 << 20  # the search never asks for more sequences than this


def _at_batch(planned, batch: int):
    """The planned point at another batch, checked against the machine's free memory only."""
    point = dataclasses.replace(planned.point, batch=batch)
    return dataclasses.replace(planned, point=point,
                               does_not_fit=shortfall(dataclasses.replace(point, memory_limit_bytes=None)))


def model_max_batch(point) -> int:
    """The largest batch whose predicted peak fits the point's memory_limit_bytes (0: not even one)."""
    limit = point.memory_limit_bytes
    fits = lambda b: predicted_peak_bytes(dataclasses.replace(point, batch=b)) <= limit  # noqa: E731
    if not fits(1):
        return 0
    low, high = 1, 2
    while high <= MAX_BATCH and fits(high):
        low, high = high, high * 2
    while high - low > 1:  # fits(low), not fits(high)
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


def plan_max_batch(point) -> int:
    """The capacity plan's answer: weights plus the cache of every sequence within the limit."""
    return capacity(point.model, point.dtype, point.memory_limit_bytes, reserve=0.0,
                    layout=point.strategy.layout).max_batch(point.max_len)


def search(cfg, planned, measure: Callable, on_probe: Callable = lambda: None) -> tuple[list, Optional[int]]:
    """Probe batches with `measure(cfg, planned)` (`on_probe()` first: the caller counts them) until the
    largest that runs is known. Returns the probed points and that batch (None: not even batch 1 runs)."""
    limit = planned.point.memory_limit_bytes
    probed, verdicts = [], {}

    def runs(batch: int) -> bool:
        if batch not in verdicts:
            probe = _at_batch(planned, batch)
            on_probe()
            measure(cfg, probe)
            probed.append(probe.point)
            row = finished_row(cfg.results_dir, probe.point.key)
            frame = pd.read_parquet(row.path) if row is not None else None
            peak = frame["peak_memory_bytes"].iloc[0] if frame is not None else None
            verdicts[batch] = bool(row is not None and row.status == "ok" and pd.notna(peak) and peak <= limit)
            log.info(f"b={batch}: {'runs' if verdicts[batch] else 'does not run'} within memory_limit_bytes="
                     f"{limit:,} (peak {_bytes(peak)}, status {row.status if row else 'no row'})")
        return verdicts[batch]

    start = max(1, min(model_max_batch(planned.point), MAX_BATCH))
    low, high = (0, start) if not runs(start) else (start, None)
    while high is None:  # double until a probe does not run
        if low * 2 > MAX_BATCH:
            high = MAX_BATCH + 1
        elif runs(low * 2):
            low *= 2
        else:
            high = low * 2
    while high - low > 1:  # runs(low) (or low == 0), not runs(high)
        middle = (low + high) // 2
        low, high = (middle, high) if runs(middle) else (low, middle)
    return probed, (low or None)


def answer_line(point, measured: Optional[int]) -> str:
    """The search's answer beside the two paper answers."""
    limit = point.memory_limit_bytes
    return (f"largest batch at ctx={point.ctx}+{point.decode_tokens} within memory_limit_bytes={limit:,} "
            f"({point.strategy.name} {point.model.name} {point.device}/{point.dtype}): measured "
            f"{measured or 'none (not even 1)'}; memory model (weights + cache + transients) "
            f"{model_max_batch(point)}; capacity plan (weights + cache) {_any(plan_max_batch(point))}")


def _any(batch: Optional[int]) -> str:
    return "any (no cache grows with the batch)" if batch is None else str(batch)


def _bytes(value) -> str:
    return "none" if value is None or pd.isna(value) else f"{int(value):,} B"

"""The roofs a point is judged against: the stored calibration of its device and dtype, or one measured
now (in a process of its own), once per process.

Records live in `<results_dir>/_calibration/` (harness.store.calibration) and are reused by every
later point on the same host until `calibrate=true` forces a new measurement. Two processes never
calibrate one device and dtype at once: `ensure` holds an exclusive lock on
`_calibration/<host>__<device>__<dtype>.lock` (harness.files.exclusive: an flock, released by the kernel
when a process dies) while it measures, and a second process waits for it, then reuses the record the
first one wrote.

A calibration has a wall-time budget (`calibration_budget_s`): it says so in the log before it starts,
each kernel's repeats stop once its share of the budget is spent (one timed run at least), and the
GEMM shrinks (halving from harness.measure.roofs.MATMUL_N) until a warm-up and two runs fit its
share, so fp16 on a CPU without fp16 units takes seconds, not minutes. The record's `method` says
how many repeats each kernel ran and which GEMM size was used.

Best-of repeats cannot undo another process that holds a core for the whole calibration (on two
cores it halved the matmul roof, and every later row "beat" it). So each calibration records the share
of the CPUs others took (`contention`); above harness.measure.contention.CONTENTION_LIMIT it is tried
again, up to ATTEMPTS times within the budget, and the least contended record is kept. One still
contended is stored with its contention and a warning naming `calibrate=true`, never silently, and it
is not kept for every later run: a later run that finds the machine quiet (`quiet_now`: others' share
over a short /proc/stat window within CONTENTION_LIMIT) measures the roofs again, and the less
contended record of the two is stored; on a machine still busy it is reused, with the warning.
"""
from __future__ import annotations

import logging
import time
from datetime import datetime, timezone
from pathlib import Path

from harness.files import WAIT_S, exclusive
from harness.measure.contention import CONTENTION_LIMIT, CpuTimes, others_fraction_since
from harness.measure.roofs import measure_within
from harness.store.calibration import Calibration, load, record_path, save  # noqa: F401 (record_path for callers)

log = logging.getLogger("harness")

DEFAULT_BUDGET_S = 120.0  # harness.config.schema.RunConfig.calibration_budget_s's default
ATTEMPTS = 3  # calibrations tried while others take the CPUs; the least contended is kept
RETRY_PAUSE_S = 3.0  # wait before trying again: a short burst elsewhere may be over by then


def lock_path(results_dir: str | Path, device: str, dtype: str) -> Path:
    return record_path(results_dir, device, dtype).with_suffix(".lock")


def ensure(results_dir: str | Path, device: str, dtype: str, force: bool, run,
           budget_s: float = DEFAULT_BUDGET_S, c_linear: bool = False) -> tuple[Calibration, bool]:
    """The calibration to judge points against: stored, or measured now via `run(measure_within, arg)`
    (the runner passes its process isolation) under the device's lock. Returns (record, measured_now).
    With `force`, a record another process wrote while this one waited for the lock counts as fresh.
    `c_linear`: the points run the C linear (matmul=c), so the roofs must include its read rate: a
    stored record without it (made by a run of torch's linears only) is measured again."""
    again = False  # a stored contended record measured again now that the machine is quiet
    if not force:
        stored = load(results_dir, device, dtype)
        again = stored is not None and _measure_again_now(stored)
        if stored is not None and covers(stored, c_linear) and not again:
            return stored, False
    label = f"{device}/{dtype}"
    asked = datetime.now(timezone.utc).isoformat(timespec="seconds")
    # harness.files' one waiting rule; a calibration takes at most its budget (ATTEMPTS within it)
    with exclusive(lock_path(results_dir, device, dtype), f"calibrating {label}", max(WAIT_S, 2 * budget_s)):
        stored = load(results_dir, device, dtype)  # written by whoever held the lock before us?
        fresh = stored is not None and stored.timestamp >= asked
        if stored is not None and covers(stored, c_linear) and (fresh or not (force or again)):
            return stored, False
        path = record_path(results_dir, device, dtype)
        log.info(f"calibrating {label}: read bandwidth and matmul roofs, budget {budget_s:.0f} s "
                 f"(calibration_budget_s); the record goes to {path} and later runs reuse it")
        began = time.monotonic()
        outcome = _least_contended(run, (device, dtype, float(budget_s), c_linear), label)
        log.info(f"calibration of {label} took {time.monotonic() - began:.1f} s")
        if (not force and stored is not None and covers(stored, c_linear) and is_contended(outcome)
                and (stored.contention or 0.0) < (outcome.contention or 0.0)):
            return stored, False  # measured again on a machine that turned busy: the stored record was less so
        save(results_dir, outcome)  # whole or not at all (a full disk leaves no temporary)
    return outcome, True


def covers(record: Calibration, c_linear: bool) -> bool:
    """Whether a stored record holds every kernel the points read with: the C linear's rate where they
    run it."""
    return not c_linear or record.read_bandwidth_c_gemv_Bps is not None


def is_contended(record: Calibration) -> bool:
    return record.contention is not None and record.contention > CONTENTION_LIMIT


def quiet_now() -> bool:
    """Whether other processes take at most CONTENTION_LIMIT of the CPUs now (a short /proc/stat window)."""
    return others_fraction_since(CpuTimes.now()) <= CONTENTION_LIMIT


def _measure_again_now(stored: Calibration) -> bool:
    """A contended record is measured again once the machine is quiet (said in the log), not reused forever."""
    if not is_contended(stored) or not quiet_now():
        return False
    log.info(f"the stored calibration ({stored.timestamp}) was measured while others took {stored.contention:.0%} of "
             "the CPUs; the machine is quiet now: measuring the roofs again")
    return True


def _least_contended(run, request: tuple[str, str, float, bool], label: str) -> Calibration:
    """Measure; while others took more than CONTENTION_LIMIT of the CPUs and the budget allows another
    attempt, wait and measure again. The least contended record, with a warning if it still is."""
    began, best, budget_s = time.monotonic(), None, request[2]
    for attempt in range(1, ATTEMPTS + 1):
        outcome = run(measure_within, request)
        if isinstance(outcome, dict):  # isolation reports a failure as a dict with a reason
            raise RuntimeError(f"calibration failed: {outcome.get('reason')}")
        if best is None or (outcome.contention or 0.0) < (best.contention or 0.0):
            best = outcome
        spent = time.monotonic() - began
        if not is_contended(best) or attempt == ATTEMPTS or spent * (attempt + 1) / attempt > budget_s:
            break
        log.warning(f"calibration of {label}: other processes took {outcome.contention:.0%} of the CPUs "
                    f"(limit {CONTENTION_LIMIT:.0%}); trying again ({attempt + 1} of {ATTEMPTS})")
        time.sleep(RETRY_PAUSE_S)
    if is_contended(best):
        log.warning(f"calibration of {label} is stored contended: other processes took {best.contention:.0%} of "
                    f"the CPUs in its best attempt, so its roofs are likely low and rows may beat them (noisy). "
                    f"Re-run with calibrate=true on a quiet machine")
    return best

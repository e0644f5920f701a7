"""The roofs a point is judged against: the stored calibration of its device and dtype, or one measured
now (in a process of its own), once per process.

Records live in `<results_dir>/_calibration/` (harness.store.calibration) and are reused by every
later point on the same host until `calibrate=true` forces a new measurement.
"""
from __future__ import annotations

from pathlib import Path

from harness.measure.roofs import measure
from harness.store.calibration import Calibration, load, record_path, save  # noqa: F401 (record_path for callers)


def ensure(results_dir: str | Path, device: str, dtype: str, force: bool, run) -> tuple[Calibration, bool]:
    """The calibration to judge points against: stored, or measured now via `run(measure, arg)` (the
    runner passes its process isolation). Returns (record, measured_now)."""
    if not force:
        stored = load(results_dir, device, dtype)
        if stored is not None:
            return stored, False
    outcome = run(measure, (device, dtype))
    if isinstance(outcome, dict):  # isolation reports a failure as a dict with a reason
        raise RuntimeError(f"calibration failed: {outcome.get('reason')}")
    save(results_dir, outcome)
    return outcome, True

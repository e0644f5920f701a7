"""The Hydra app behind `python -m harness.run`: one point, or with -m / +sweep=<name>, a sweep.

Pipeline per point: composed config -> Point (resolved once, by the plan) -> skip if its row exists ->
measure in its own process -> row (the point's dataclasses + measurement + analytic model + metadata)
-> one Parquet file, atomically.
"""
from __future__ import annotations

import logging
import sys
from collections import Counter
import time
from dataclasses import dataclass, field

import hydra
from hydra.core.hydra_config import HydraConfig

from harness.config import ConfigError, register_schemas
from harness.measure.point import measure_point, not_run
from harness.run import calibration
from harness.run.isolation import run_inline, run_isolated
from harness.run.plan import CONFIG_DIR, CONFIG_NAME, needs_preflight, plan
from harness.run.resolve import cuda_available, point_from_config
from harness.run.row import build_row
from harness.store.files import finished_keys, remove_stale_temporaries, write_row

log = logging.getLogger("harness")


@dataclass
class Progress:
    """Counts and timing across the points of this process, for the progress line and the summary."""

    total: int = 1  # points this command line expands to
    done: int = 0  # points handled so far (measured, skipped or already present)
    started: float = field(default_factory=time.monotonic)
    measured_seconds: list = field(default_factory=list)  # wall time of each point that ran
    statuses: Counter = field(default_factory=Counter)  # status -> count

    def eta_seconds(self) -> float | None:
        if not self.measured_seconds:
            return None
        return (self.total - self.done) * sum(self.measured_seconds) / len(self.measured_seconds)

    def line(self, label: str, outcome: str) -> str:
        elapsed = time.monotonic() - self.started
        eta = self.eta_seconds()
        left = f", ~{_clock(eta)} left" if eta is not None and self.done < self.total else ""
        return f"[{self.done}/{self.total}] {label}: {outcome} (elapsed {_clock(elapsed)}{left})"


PROGRESS = Progress()
CALIBRATIONS: dict = {}  # (results_dir, device, dtype) -> Calibration, once per process
PLANNED: dict = {}  # sorted job overrides -> PlannedPoint, filled by main() before Hydra runs the jobs


def roofs_for(cfg, point, run):
    """Stored roofs for the point's device and dtype, measured first if missing (or once per process
    when calibrate=true). A failed calibration leaves the roofs null rather than stopping the sweep."""
    key = (cfg.results_dir, point.device, point.dtype)
    if key not in CALIBRATIONS:
        try:
            record, measured_now = calibration.ensure(cfg.results_dir, point.device, point.dtype, cfg.calibrate, run)
        except RuntimeError as error:
            log.warning(f"{error}; rows of {point.device}/{point.dtype} get no roofs")
            record, measured_now = None, False
        if measured_now:
            log.info(
                f"calibrated {point.device}/{point.dtype}: read {record.read_bandwidth_Bps / 1e9:.1f} GB/s, "
                f"matmul {record.matmul_flops / 1e12:.3f} TFLOP/s -> {calibration.record_path(*key)}"
            )
        CALIBRATIONS[key] = record
    return CALIBRATIONS[key]


def _clock(seconds: float) -> str:
    minutes, secs = divmod(int(round(seconds)), 60)
    return f"{minutes}:{secs:02d}"


def _outcome(row: dict) -> str:
    if row["status"] == "ok":
        bandwidth, flops = row["bandwidth_fraction"], row["flops_fraction"]
        of_roof = (f", roofs: {bandwidth:.0%} of read, {flops:.0%} of FLOP/s ({row['roof_bound']} bound)"
                   if bandwidth is not None else "")
        return f"ok, {row['decode_step_s'] * 1e3:.2f} ms/step, {row['tokens_per_s']:.1f} tok/s{of_roof}"
    return f"{row['status']}: {row['reason']}"


def measured_traffic(point) -> dict:
    """DRAM bytes per step from Nsight Compute; on failure the row keeps traffic_source=model."""
    from harness.measure.ncu import measure_traffic

    try:
        return measure_traffic(point)
    except RuntimeError as error:
        log.warning(f"{point.label()}: ncu traffic not measured, traffic_source stays model: {error}")
        return {}


def planned_point(cfg):
    """This job's PlannedPoint: the plan's, found by the job's overrides; resolved here only when the
    job runs in a process the plan did not run in (a launcher that starts jobs elsewhere)."""
    overrides = tuple(sorted(HydraConfig.get().overrides.task))
    if overrides in PLANNED:
        return PLANNED[overrides]
    from harness.run.plan import PlannedPoint

    point = point_from_config(cfg)
    return PlannedPoint(overrides, cfg, point, None)


@hydra.main(config_path=CONFIG_DIR, config_name=CONFIG_NAME, version_base="1.3")
def run_point(cfg) -> None:
    planned = planned_point(cfg)
    point = planned.point
    PROGRESS.done += 1
    if not cfg.overwrite and point.key in finished_keys(cfg.results_dir):
        PROGRESS.statuses["already measured"] += 1
        log.info(PROGRESS.line(point.label(), "already measured, skipped (overwrite=true re-runs it)"))
        return
    run = run_isolated if cfg.isolate else run_inline
    roofs = roofs_for(cfg, point, run)
    began = time.monotonic()
    if planned.does_not_fit is not None:
        measured = not_run("skipped", planned.does_not_fit)
    else:
        measured = run(measure_point, point)
    if point.traffic == "ncu" and measured.get("status") == "ok":
        measured.update(measured_traffic(point))
    row = build_row(point, measured, roofs)
    write_row(cfg.results_dir, row)
    if row["status"] != "skipped":
        PROGRESS.measured_seconds.append(time.monotonic() - began)
    PROGRESS.statuses[row["status"]] += 1
    log.info(PROGRESS.line(point.label(), _outcome(row)))
    if "traceback" in measured:
        log.debug(measured["traceback"])


def main() -> int:
    argv = sys.argv[1:]
    register_schemas()
    if needs_preflight(argv):
        try:
            the_plan = plan(argv, cuda_available)
        except ConfigError as error:
            print(f"error: {error}", file=sys.stderr)
            return 2
        PROGRESS.total = len(the_plan.jobs)
        PLANNED.update({tuple(sorted(job.overrides)): job for job in the_plan.jobs})
        for job in the_plan.jobs[:1]:
            remove_stale_temporaries(job.config.results_dir)
    run_point()
    summary = ", ".join(f"{count} {status}" for status, count in sorted(PROGRESS.statuses.items()))
    log.info(f"{PROGRESS.done} point(s) in {_clock(time.monotonic() - PROGRESS.started)}: {summary}")
    return 1 if PROGRESS.statuses.get("failed") else 0

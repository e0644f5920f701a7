"""The Hydra app behind `python -m harness.run`: one point, or with -m / +sweep=<name>, a sweep.

Pipeline per point: composed config -> Point (resolved once, by the plan) -> skip if its row is
finished (harness.store.files.finished_row: the file reads and holds one row), unless it failed
(rerun_failed, true by default), another code state made it (rerun_other_code) or overwrite=true ->
measure in its own process -> row (the point's dataclasses + measurement + analytic model + metadata)
-> one Parquet file, atomically.

Exit codes: 0 every point ran or was already there; 1 some point failed (its row says why; the rest
went on); 2 bad input, nothing ran (one line `error: <key>: ...`); 3 a fault stopped the sweep
(results_dir full or unwritable: one line, every row written so far whole, a re-run completes the
sweep); 130 interrupted (Ctrl-C: one line, rows written so far whole).
"""
from __future__ import annotations

import os
import signal
import sys

if sys.argv and sys.argv[0].endswith(os.path.join("harness", "run", "__main__.py")):
    # `python -m harness.run`: a Ctrl-C while torch and Hydra import (seconds, nothing written yet)
    # ends in one line rather than an import traceback. main() puts the usual handler back.
    def _interrupted_while_starting(signum, frame):
        sys.stderr.write("interrupted while starting: nothing written\n")
        os._exit(130)

    signal.signal(signal.SIGINT, _interrupted_while_starting)

import errno  # noqa: E402 (the handler above first: these imports take seconds)
import logging  # noqa: E402
import time  # noqa: E402
from collections import Counter  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402

import hydra  # noqa: E402
from hydra.core.hydra_config import HydraConfig  # noqa: E402

from harness.config import ConfigError, register_schemas  # noqa: E402
from harness.measure.contention import ROOF_LIMIT  # noqa: E402
from harness.measure.point import measure_point, not_run  # noqa: E402
from harness.run import calibration  # noqa: E402
from harness.run.isolation import PointInterrupted, run_inline, run_isolated, stop_fork_server  # noqa: E402
from harness.run import capacity_search  # noqa: E402
from harness.run.metadata import git_commit, same_code  # noqa: E402
from harness.run.summary import closing_line  # noqa: E402
from harness.run.plan import CONFIG_DIR, CONFIG_NAME, needs_preflight, plan  # noqa: E402
from harness.run.resolve import cuda_available, point_from_config  # noqa: E402
from harness.run.row import build_row  # noqa: E402
from harness.store.files import finished_row, remove_stale_temporaries, write_row  # noqa: E402

log = logging.getLogger("harness")
LAUNCHER_LOGGERS = ("hydra._internal.core_plugins.basic_launcher",
                    "hydra_plugins.hydra_submitit_launcher.submitit_launcher")


@dataclass
class Progress:
    """Counts and timing across the points of this process, for the progress line and the summary."""

    total: int = 1  # points this command line expands to
    done: int = 0  # points handled so far (measured, skipped or already present)
    started: float = field(default_factory=time.monotonic)
    measured_seconds: list = field(default_factory=list)  # wall time of each point that ran
    statuses: Counter = field(default_factory=Counter)  # status -> count
    written: int = 0  # rows this process wrote

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
STORED_CALIBRATION: dict = {}  # same key -> True while the record in use was stored by an earlier run
PLANNED: dict = {}  # sorted job overrides -> PlannedPoint, filled by main() before Hydra runs the jobs


def roofs_for(cfg, point, run):
    """Stored roofs for the point's device and dtype, measured first if missing (or once per process
    when calibrate=true). A failed calibration leaves the roofs null rather than stopping the sweep."""
    key = (cfg.results_dir, point.device, point.dtype)
    if key not in CALIBRATIONS:
        try:
            record, measured_now = calibration.ensure(cfg.results_dir, point.device, point.dtype, cfg.calibrate, run,
                                                      budget_s=cfg.calibration_budget_s)
        except RuntimeError as error:
            log.warning(f"{error}; rows of {point.device}/{point.dtype} get no roofs")
            record, measured_now = None, False
        if measured_now:
            log.info(
                f"calibrated {point.device}/{point.dtype}: read {record.read_bandwidth_Bps / 1e9:.1f} GB/s, "
                f"matmul {record.matmul_flops / 1e12:.3f} TFLOP/s -> {calibration.record_path(*key)}"
            )
        elif record is not None and calibration.is_contended(record):
            log.warning(f"the stored calibration {calibration.record_path(*key)} ({record.timestamp}) was measured "
                        f"while other processes took {record.contention:.0%} of the CPUs: its roofs are likely "
                        "low; calibrate=true measures them again")
        CALIBRATIONS[key] = record
        STORED_CALIBRATION[key] = record is not None and not measured_now
    return CALIBRATIONS[key]


def warn_if_beaten(cfg, point, row: dict) -> None:
    """Once per device and dtype: a row faster than a stored record's roofs says the record is wrong
    (measured on a busy machine, or before a faster kernel), and names the switch that re-measures it."""
    key = (cfg.results_dir, point.device, point.dtype)
    beaten = {name: row[name] for name in ("bandwidth_fraction", "flops_fraction")
              if row.get(name) is not None and row[name] > ROOF_LIMIT}
    if not beaten or not STORED_CALIBRATION.get(key):
        return
    STORED_CALIBRATION[key] = False  # said once
    record = CALIBRATIONS[key]
    figures = ", ".join(f"{name} {value:.2f}" for name, value in beaten.items())
    log.warning(f"{point.label()} beats the stored calibration {calibration.record_path(*key)} "
                f"({record.timestamp}): {figures} > {ROOF_LIMIT}, so its roofs are too low; "
                "re-run with calibrate=true")


def _clock(seconds: float) -> str:
    minutes, secs = divmod(int(round(seconds)), 60)
    return f"{minutes}:{secs:02d}"


def _outcome(row: dict) -> str:
    if row["status"] == "ok":
        bandwidth, flops = row["bandwidth_fraction"], row["flops_fraction"]
        of_roof = (f", roofs: {bandwidth:.0%} of read, {flops:.0%} of FLOP/s ({row['roof_bound']} bound)"
                   if bandwidth is not None else "")
        noisy = f"; NOISY: {row['noise_reason']}" if row["noisy"] else ""
        return f"ok, {row['decode_step_s'] * 1e3:.2f} ms/step, {row['tokens_per_s']:.1f} tok/s{of_roof}{noisy}"
    return f"{row['status']}: {row['reason']}"


def measured_traffic(point) -> dict:
    """DRAM bytes per step from Nsight Compute; on failure the row keeps traffic_source=model."""
    from harness.measure.ncu import measure_traffic

    try:
        return measure_traffic(point)
    except RuntimeError as error:
        log.warning(f"{point.label()}: ncu traffic not measured, traffic_source stays model: {error}")
        return {}


def sweep_parallelism() -> int:
    """Points of this sweep the launcher may run at once: Hydra's sweeper batch (conf/config.yaml sets
    it to the launcher's array_parallelism, else 1); 1 for a single point."""
    sweeper = HydraConfig.get().get("sweeper") or {}
    return max(1, int(sweeper.get("max_batch_size") or 1)) if HydraConfig.get().mode.name == "MULTIRUN" else 1


def planned_point(cfg):
    """This job's PlannedPoint: the plan's, found by the job's overrides; resolved here only when the
    job runs in a process the plan did not run in (a launcher that starts jobs elsewhere)."""
    overrides = tuple(sorted(HydraConfig.get().overrides.task))
    if overrides in PLANNED:
        return PLANNED[overrides]
    from harness.run.plan import PlannedPoint

    point = point_from_config(cfg)
    return PlannedPoint(overrides, cfg, point, None)


class SweepStopped(BaseException):
    """A fault that ends the sweep (results_dir full or unwritable). A BaseException, so that Hydra's
    job runner does not record it as one job's failure and go on to the next; main() says it in one
    line."""


def rerun_reason(row, cfg) -> str | None:
    """Why a point whose row is finished is measured again, or None to keep its row."""
    if cfg.overwrite:
        return "overwrite=true"
    if row.status == "failed" and cfg.rerun_failed:
        return "its row failed (rerun_failed=false keeps failed rows)"
    if cfg.rerun_other_code and not same_code(row.git_commit, git_commit()):
        return f"its row was made by other code (git_commit {row.git_commit}; rerun_other_code=true)"
    return None


def _kept(row) -> str:
    """The progress line's outcome for a point whose row is kept."""
    outcome = "already measured, skipped (overwrite=true re-runs it)"
    if row.status == "failed":
        outcome = "already measured: failed, kept (rerun_failed=false)"
    if not same_code(row.git_commit, git_commit()):
        outcome += f"; made by other code (git_commit {row.git_commit}; rerun_other_code=true re-measures it)"
    return outcome


@hydra.main(config_path=CONFIG_DIR, config_name=CONFIG_NAME, version_base="1.3")
def run_point(cfg) -> None:
    try:
        _run_point(cfg)
    except OSError as error:  # the results folder (a row, a calibration record) cannot be written
        raise SweepStopped(error) from error


def _run_point(cfg) -> None:
    measure_planned(cfg, planned_point(cfg), sweep_parallelism())


def measure_planned(cfg, planned, parallelism: int = 1) -> None:
    """One point: kept if its row is finished (and no rerun rule applies), else measured (or a skipped
    row when it cannot fit), its row written whole, its progress line logged."""
    point = planned.point
    PROGRESS.done += 1
    finished = finished_row(cfg.results_dir, point.key)
    if finished is not None:
        reason = rerun_reason(finished, cfg)
        if reason is None:
            PROGRESS.statuses["already measured"] += 1
            log.info(PROGRESS.line(point.label(), _kept(finished)))
            return
        log.info(f"{point.label()}: measuring again: {reason}")
    run = run_isolated if cfg.isolate else run_inline
    roofs = roofs_for(cfg, point, run)
    began = time.monotonic()
    if planned.does_not_fit is not None:
        measured = not_run("skipped", planned.does_not_fit)
    else:
        measured = run(measure_point, point)
    if point.traffic == "ncu" and measured.get("status") == "ok":
        measured.update(measured_traffic(point))
    row = build_row(point, measured, roofs, parallelism)
    write_row(cfg.results_dir, row)
    PROGRESS.written += 1
    if row["status"] != "skipped":
        PROGRESS.measured_seconds.append(time.monotonic() - began)
    PROGRESS.statuses[row["status"]] += 1
    log.info(PROGRESS.line(point.label(), _outcome(row)))
    warn_if_beaten(cfg, point, row)
    if "traceback" in measured:
        log.debug(measured["traceback"])


def _is_full(error: BaseException) -> bool:
    """Whether a fault (or what caused it) is a full disk or an exhausted quota."""
    while error is not None:
        if isinstance(error, OSError) and (error.errno in (errno.ENOSPC, errno.EDQUOT)
                                           or "No space left on device" in str(error)):
            return True
        error = error.__cause__ or error.__context__
    return False


def _fault_line(error: BaseException, results_dir: str) -> str:
    cause = error.__cause__ if isinstance(error, SweepStopped) and error.__cause__ else error
    rows = f"{PROGRESS.written} rows"
    if _is_full(error):
        return (f"error: results_dir is full after {rows} ('{results_dir}': {_one_line(cause)}); every row written "
                "is whole: free space and run the same command again to complete the sweep")
    return (f"error: stopped after {rows} written to '{results_dir}': {_one_line(cause)}; every row written is "
            "whole: fix it and run the same command again to complete the sweep")


def _one_line(error: BaseException) -> str:
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0]}" if text else type(error).__name__


def quiet_launchers(argv: list[str]) -> None:
    """Hydra's launchers log two lines per job (`Launching 1 jobs locally`, `#0 : <overrides>`) before
    every progress line of ours, which says the same; they are kept for `hydra.verbose`."""
    if any(arg.lstrip("+").startswith("hydra.verbose") for arg in argv):
        return
    for name in LAUNCHER_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)


def _search_max_batch(planned) -> list:
    """search=max_batch: the probes run here, one at a time (no Hydra job: the log goes to the console)."""
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s][%(name)s][%(levelname)s] - %(message)s")
    def one_more() -> None:  # the progress line's total grows with the probes
        PROGRESS.total = PROGRESS.done + 1

    probed, largest = capacity_search.search(planned.config, planned, measure_planned, one_more)
    log.info(capacity_search.answer_line(planned.point, largest))
    return probed


def main() -> int:
    signal.signal(signal.SIGINT, signal.default_int_handler)
    argv = sys.argv[1:]
    register_schemas()
    if not needs_preflight(argv):
        run_point()  # --help, --cfg, ...: Hydra prints and exits, no point runs
        return 0
    try:
        the_plan = plan(argv, cuda_available)
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted before the first point: nothing written", file=sys.stderr)
        return 130
    quiet_launchers(argv)
    PROGRESS.total = len(the_plan.jobs)
    PLANNED.update({tuple(sorted(job.overrides)): job for job in the_plan.jobs})
    results_dir = the_plan.results_dir
    # Faults reach this function (not Hydra's report, which prints a traceback), and a log file on a
    # full disk drops its lines instead of printing logging's own tracebacks; the console keeps them.
    os.environ["HYDRA_FULL_ERROR"] = "1"
    logging.raiseExceptions = False
    first = the_plan.jobs[0]
    points = [job.point for job in the_plan.jobs]
    try:
        remove_stale_temporaries(results_dir)
        if first.config.search == "max_batch":
            points = _search_max_batch(first)
        else:
            run_point()
    except (KeyboardInterrupt, PointInterrupted):
        stop_fork_server()
        print(f"interrupted: {PROGRESS.written} rows written to '{results_dir}', each whole; run the same "
              "command again to complete the sweep", file=sys.stderr)
        return 130
    except SystemExit:
        raise
    except BaseException as error:  # noqa: BLE001 - a fault of the output or of Hydra: one line
        print(_fault_line(error, results_dir), file=sys.stderr)
        return 3
    line, outcome = closing_line(results_dir, points, PROGRESS.statuses, _clock(time.monotonic() - PROGRESS.started))
    log.info(line)
    # Exit 1: a point failed in this run (a failed row kept by rerun_failed=false is not this run's
    # failure), or left no row. A launcher that ran the points elsewhere left this process no counts.
    measured_elsewhere = PROGRESS.done == 0
    failed_now = PROGRESS.statuses.get("failed") or (measured_elsewhere and outcome.failed)
    return 1 if failed_now or outcome.missing else 0

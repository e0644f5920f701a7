"""The Hydra app behind `python -m harness.run`: one point, or with -m / +sweep=<name>, a sweep.

Pipeline: command line -> every point composed, checked and resolved once (harness.run.plan) -> the
points grouped by shape (harness.run.grouping: interleave=shape times a shape's strategies together) ->
each group's members kept if their row is finished (harness.store.files.finished_row), unless it
failed (rerun_failed, true by default), another code state made it (rerun_other_code) or
overwrite=true -> the group measured in its own process -> a row per member (the point's dataclasses
+ measurement + analytic model + metadata) -> one Parquet file each, atomically (harness.run.execute).
Hydra still runs one job per point; the job that leads a group measures it, the others find their rows.

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

import hydra  # noqa: E402
from hydra.core.hydra_config import HydraConfig  # noqa: E402

from harness.config import ConfigError, register_schemas  # noqa: E402
from harness.config.validate import first_line  # noqa: E402
from harness.run import capacity_search  # noqa: E402
from harness.run.execute import PROGRESS, clock, measure_groups, measure_planned  # noqa: E402
from harness.run.grouping import PlannedGroup, find_work, leaders, leave_work  # noqa: E402
from harness.run.isolation import PointInterrupted, stop_fork_server  # noqa: E402
from harness.run.closing import closing_line  # noqa: E402
from harness.run.plan import (CONFIG_DIR, CONFIG_NAME, PlannedPoint, check_printed_config,  # noqa: E402
                              hydra_order, needs_preflight, plan)
from harness.run.resolve import cuda_available, point_from_config  # noqa: E402
from harness.store.files import remove_stale_temporaries  # noqa: E402

log = logging.getLogger("harness")
LAUNCHER_LOGGERS = ("hydra._internal.core_plugins.basic_launcher",
                    "hydra_plugins.hydra_submitit_launcher.submitit_launcher")


# Every group of the sweep, in measuring order, when its jobs run in this process: the first job to run
# takes them all (None: the jobs run in a launcher's processes, which find their work in results_dir).
PENDING: list | None = None


def sweep_parallelism() -> int:
    """Points of this sweep the launcher may run at once: Hydra's sweeper batch (conf/config.yaml sets
    it to the launcher's array_parallelism, else 1); 1 for a single point."""
    sweeper = HydraConfig.get().get("sweeper") or {}
    return max(1, int(sweeper.get("max_batch_size") or 1)) if HydraConfig.get().mode.name == "MULTIRUN" else 1


def job_work(cfg) -> list[PlannedGroup]:
    """The groups this Hydra job measures: in this process, every group for the first job and none for
    the others (their points were measured with it); for a launcher's job, those the plan left it in
    results_dir; its own point alone for a job started without the plan."""
    global PENDING
    overrides = HydraConfig.get().overrides.task
    if PENDING is not None:
        groups, PENDING = PENDING, []
        return groups
    left = find_work(cfg.results_dir, overrides)
    if left is not None:
        return left
    point = point_from_config(cfg)
    return [PlannedGroup(point.key[:12], [PlannedPoint(tuple(overrides), cfg, point, None)])]


class SweepStopped(BaseException):
    """A fault that ends the sweep (results_dir full or unwritable). A BaseException, so that Hydra's
    job runner does not record it as one job's failure and go on to the next; main() says it in one
    line."""


@hydra.main(config_path=CONFIG_DIR, config_name=CONFIG_NAME, version_base="1.3")
def run_point(cfg) -> None:
    try:
        _run_point(cfg)
    except OSError as error:  # the results folder (a row, a calibration record) cannot be written
        raise SweepStopped(error) from error


def _run_point(cfg) -> None:
    measure_groups(job_work(cfg), sweep_parallelism())


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
        return (f"error: results_dir is full after {rows} ('{results_dir}': {first_line(cause)}); every row written "
                "is whole: free space and run the same command again to complete the sweep")
    return (f"error: stopped after {rows} written to '{results_dir}': {first_line(cause)}; every row written is "
            "whole: fix it and run the same command again to complete the sweep")


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


def _assign_work(the_plan) -> None:
    """Tell the Hydra jobs which groups they measure: all of them to the first job, when the jobs run in
    this process; else each group to its first member's job, through files in results_dir that a
    launcher's jobs read (harness.run.grouping)."""
    global PENDING
    if the_plan.in_process:
        PENDING = list(the_plan.groups)
    else:
        leave_work(the_plan.results_dir, the_plan.jobs, leaders(the_plan.groups))


def main() -> int:
    signal.signal(signal.SIGINT, signal.default_int_handler)
    argv = sys.argv[1:]
    register_schemas()
    if not needs_preflight(argv):
        try:
            check_printed_config(argv)  # --cfg job --resolve: an interpolation that does not resolve
            run_point()  # --help, --cfg, ...: Hydra prints and exits, no point runs
        except ConfigError as error:
            print(f"error: {error}", file=sys.stderr)
            return 2
        except ValueError as error:  # Hydra's refusal of its own flags (two modes at once, an unknown --cfg kind)
            print(f"error: command line: {str(error).splitlines()[0]}", file=sys.stderr)
            return 2
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
    sys.argv[1:] = hydra_order(argv)  # Hydra's parser takes flags before overrides only
    points = the_plan.points
    PROGRESS.total = len(points)
    results_dir = the_plan.results_dir
    # Faults reach this function (not Hydra's report, which prints a traceback), and a log file on a
    # full disk drops its lines instead of printing logging's own tracebacks; the console keeps them.
    os.environ["HYDRA_FULL_ERROR"] = "1"
    logging.raiseExceptions = False
    first = the_plan.jobs[0]
    try:
        remove_stale_temporaries(results_dir)
        if first.config.search == "max_batch":
            points = _search_max_batch(first)
        else:
            _assign_work(the_plan)
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
    line, outcome = closing_line(results_dir, points, PROGRESS.statuses, clock(time.monotonic() - PROGRESS.started))
    log.info(line)
    # Exit 1: a point failed in this run (a failed row kept by rerun_failed=false is not this run's
    # failure), or left no row. A launcher that ran the points elsewhere left this process no counts.
    measured_elsewhere = PROGRESS.done == 0
    failed_now = PROGRESS.statuses.get("failed") or (measured_elsewhere and outcome.failed)
    return 1 if failed_now or outcome.missing else 0

"""The Hydra app behind `python -m harness.run`: one point, or with -m / +sweep=<name>, a sweep.

Pipeline: command line -> every point composed, checked and resolved once (harness.run.plan) -> the
points grouped by shape (harness.run.grouping: interleave=shape times a shape's strategies together) ->
one Hydra job per group, through the chosen launcher (harness.run.launch) -> each group's members kept
if their row is finished (harness.store.files.finished_row), unless it failed (rerun_failed, true by
default), another code state made it (rerun_other_code) or overwrite=true -> the group measured in a
process of its own -> a row per member (the point's dataclasses + measurement + analytic model +
metadata) -> one Parquet file each, atomically (harness.run.execute) -> the groups judged against each
other once every job is back, a slow window measured again (harness.run.windows).

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

from harness.config import ConfigError, register_schemas  # noqa: E402
from harness.config.validate import first_line  # noqa: E402
from harness.run import capacity_search  # noqa: E402
from harness.run.execute import Progress, RunContext, clock, measure_planned  # noqa: E402
from harness.run.isolation import PointInterrupted, stop_fork_server  # noqa: E402
from harness.run.closing import closing_line  # noqa: E402
from harness.run.launch import SweepStopped, run_sweep  # noqa: E402
from harness.run.plan import CONFIG_DIR, CONFIG_NAME, check_printed_config, hydra_order, needs_preflight, plan  # noqa: E402
from harness.run.resolve import cuda_available  # noqa: E402
from harness.store.files import remove_stale_temporaries  # noqa: E402

log = logging.getLogger("harness")
LAUNCHER_LOGGERS = ("hydra._internal.core_plugins.basic_launcher",
                    "hydra_plugins.hydra_submitit_launcher.submitit_launcher")


@hydra.main(config_path=CONFIG_DIR, config_name=CONFIG_NAME, version_base="1.3")
def show_config(cfg) -> None:
    """Hydra's own flags (--help, --cfg, --info, ...): Hydra prints and exits before any job runs; the
    points of a command line run as group jobs (harness.run.launch), never here."""


def _is_full(error: BaseException) -> bool:
    """Whether a fault (or what caused it) is a full disk or an exhausted quota."""
    while error is not None:
        if isinstance(error, OSError) and (error.errno in (errno.ENOSPC, errno.EDQUOT)
                                           or "No space left on device" in str(error)):
            return True
        error = error.__cause__ or error.__context__
    return False


def _fault_line(error: BaseException, results_dir: str, written: int) -> str:
    cause = error.__cause__ if isinstance(error, SweepStopped) and error.__cause__ else error
    rows = f"{written} rows"
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


def _search_max_batch(context: RunContext, planned) -> list:
    """search=max_batch: the probes run here, one at a time (no Hydra job: the log goes to the console)."""
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s][%(name)s][%(levelname)s] - %(message)s")
    def one_more() -> None:  # the progress line's total grows with the probes
        context.progress.total = context.progress.done + 1

    probed, largest = capacity_search.search(planned.config, planned,
                                             lambda cfg, probe: measure_planned(context, probe), one_more)
    log.info(capacity_search.answer_line(planned.point, largest))
    return probed


def main() -> int:
    signal.signal(signal.SIGINT, signal.default_int_handler)
    argv = sys.argv[1:]
    register_schemas()
    if not needs_preflight(argv):
        try:
            check_printed_config(argv)  # --cfg job --resolve: an interpolation that does not resolve
            show_config()  # --help, --cfg, ...: Hydra prints and exits, no point runs
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
    context = RunContext(Progress(total=len(points)))
    progress = context.progress
    results_dir = the_plan.results_dir
    # Faults reach this function (not Hydra's report, which prints a traceback), and a log file on a
    # full disk drops its lines instead of printing logging's own tracebacks; the console keeps them.
    os.environ["HYDRA_FULL_ERROR"] = "1"
    logging.raiseExceptions = False
    first = the_plan.planned[0]
    try:
        remove_stale_temporaries(results_dir)
        if first.config.search == "max_batch":
            points = _search_max_batch(context, first)
        else:
            run_sweep(the_plan, context)
    except (KeyboardInterrupt, PointInterrupted):
        stop_fork_server()
        print(f"interrupted: {progress.written} rows written to '{results_dir}', each whole; run the same "
              "command again to complete the sweep", file=sys.stderr)
        return 130
    except SystemExit:
        raise
    except BaseException as error:  # noqa: BLE001 - a fault of the output or of Hydra: one line
        print(_fault_line(error, results_dir, progress.written), file=sys.stderr)
        return 3
    line, outcome = closing_line(results_dir, points, progress.statuses, clock(time.monotonic() - progress.started))
    log.info(line)
    # Exit 1: a point failed in this run (a failed row kept by rerun_failed=false is not this run's
    # failure), or left no row. A launcher that ran the points elsewhere left this process no counts.
    measured_elsewhere = progress.done == 0
    failed_now = progress.statuses.get("failed") or (measured_elsewhere and outcome.failed)
    return 1 if failed_now or outcome.missing else 0

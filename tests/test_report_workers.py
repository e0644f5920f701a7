"""The report's forked workers (the loader's readers, the plotting sections: harness.files.workers) end with
the report, however it ends, and every wait on one is bounded. Killed (SIGKILL, SIGTERM) while a worker
reads or plots, or while a worker is blocked writing a result larger than a pipe holds, the report leaves
no process behind; interrupted (SIGINT, to it alone or to its process group) while it waits on a worker,
it returns at once.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness.files.workers import Forked, WorkerLost
from tests.conftest import REPO_ROOT
from tests.report_fixtures import write_results

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="workers are forked on Linux only")


def children(pid: int) -> set[int]:
    """The processes whose parent is `pid`."""
    found = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:  # gone meanwhile
            continue
        if int(fields[1]) == pid:
            found.add(int(stat.parent.name))
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie has ended: only its parent's wait is left


def wait_for(condition, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


def test_a_worker_sends_back_its_result():
    with Forked(lambda n: list(range(n)), 5) as worker:
        assert worker.result(30) == [0, 1, 2, 3, 4]
    assert not alive(worker.process.pid)


def test_a_worker_that_raises_or_dies_sends_no_result_and_says_why():
    def fails():
        raise ValueError("a line\nand more")

    with Forked(fails) as worker, pytest.raises(WorkerLost, match="^ValueError: a line$"):
        worker.result(30)
    with Forked(os._exit, 3) as worker, pytest.raises(WorkerLost, match="exit code 3"):
        worker.result(30)


def test_a_wait_on_a_stuck_worker_is_bounded_and_the_worker_ended():
    began = time.monotonic()
    with Forked(time.sleep, 600) as worker, pytest.raises(WorkerLost, match="no result within"):
        worker.result(0.5)
    assert time.monotonic() - began < 10 and not alive(worker.process.pid)


# A parent that starts a worker whose result (200 MB) far outgrows a pipe, and never reads it.
BLOCKED = """
import sys, time
from harness.files.workers import Forked
worker = Forked(lambda: b"x" * 200_000_000)
print(worker.process.pid, flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_a_worker_blocked_writing_its_result_ends_with_its_parent(signum):
    parent = subprocess.Popen([sys.executable, "-c", BLOCKED], cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    try:
        worker = int(parent.stdout.readline())
        time.sleep(1.0)  # the worker has filled the pipe and waits in its write
        assert alive(worker)
        parent.send_signal(signum)
        assert wait_for(lambda: not alive(worker), 10), "the worker outlived its parent"
    finally:
        parent.kill()
        parent.wait(10)


# The report's command line with its workers held at the stage named first: `read` (the loader's readers,
# the folder cut into slices of 2 files) or `plot` (the plotting sections, apart from the first row).
HELD = """
import sys, time
from harness.analysis import row_files
from harness.report import apart
from harness.report.__main__ import main
stage = sys.argv[1]
if stage == "read":
    row_files.FILES_PER_PROCESS = 2
    real = row_files._read_slice_ipc
    row_files._read_slice_ipc = lambda *args: (time.sleep(600), real(*args))[1]
else:
    apart.APART_MIN_ROWS = 1
    real = apart._build
    apart._build = lambda *args: (time.sleep(600), real(*args))[1]
sys.exit(main(sys.argv[2:]))
"""


def held_report(tmp_path, stage: str) -> tuple[subprocess.Popen, set[int]]:
    """The report started with its workers held at `stage`, and the workers once they are there."""
    if len(os.sched_getaffinity(0)) < 2 and stage == "read":
        pytest.skip("the loader forks readers only where it may run on two CPUs or more")
    folder = write_results(tmp_path / "results", awkward=False, batches=(1, 4), contexts=(64, 256))
    report = subprocess.Popen([sys.executable, "-c", HELD, stage, f"results_dir={folder}", f"out={tmp_path / 'out'}"],
                              cwd=REPO_ROOT, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    assert wait_for(lambda: children(report.pid), 60), "no worker started"
    return report, children(report.pid)


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["read", "plot"])
@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_a_report_killed_while_its_workers_work_leaves_none_behind(tmp_path, stage, signum):
    report, workers = held_report(tmp_path, stage)
    try:
        report.send_signal(signum)
        assert wait_for(lambda: not any(alive(pid) for pid in workers), 10), "a worker outlived the report"
    finally:
        if report.poll() is None:
            os.killpg(report.pid, signal.SIGKILL)
        report.wait(10)


@pytest.mark.slow
@pytest.mark.parametrize("group", [False, True], ids=["to the report", "to its process group"])
def test_ctrl_c_while_the_report_plots_returns_at_once(tmp_path, group):
    report, workers = held_report(tmp_path, "plot")
    try:
        (os.killpg if group else os.kill)(report.pid, signal.SIGINT)
        _, err = report.communicate(timeout=15)
        assert report.returncode == 130 and "Traceback" not in err and err.strip().startswith("interrupted")
        assert wait_for(lambda: not any(alive(pid) for pid in workers), 10)
    finally:
        if report.poll() is None:
            os.killpg(report.pid, signal.SIGKILL)
            report.wait(10)

"""The cluster launchers of conf/hydra/launcher/ (docs/cluster.md), through hydra-submitit-launcher.

A sweep lands every row exactly once, one job per measured group (the points timed together), none
idle, every job's logs under the sweep's one folder in <results_dir>/_hydra/; the local launcher runs
its groups one at a time; a sweep or a job
that dies leaves only whole rows (a dead job ends the sweep with an error once submitit sees it gone),
and the next run of the same command measures the missing points and keeps the others.

The local launcher's tests run wherever the plugin is installed (pip install -e ".[cluster]"). The
Slurm test needs a cluster that answers; nothing here starts a daemon: .ci/slurm.sh starts a one-node
Slurm on the CI host and runs it there with HARNESS_REQUIRE_SLURM=1 (then a cluster that does not
answer fails it instead of skipping it). The points are tiny and run in the job's own process
(isolate=false) with a short calibration, so each test stays under a minute on two cores;
.ci/slurm.sh's own sweep runs with the defaults.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from datetime import datetime
from pathlib import Path

import pandas as pd
import pytest

from tests.conftest import REPO_ROOT, run_cli

pytest.importorskip("hydra_plugins.hydra_submitit_launcher",
                    reason='hydra-submitit-launcher is not installed (pip install -e ".[cluster]")')

POINTS = ["model=tiny", "strategy=contiguous,no_cache", "batch=1,2", "ctx=16", "decode_tokens=4", "device=cpu"]
QUICK = ["isolate=false", "calibration_budget_s=2"]
SUBMITIT_TIME = re.compile(r"submitit \w+ \((\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})\) - (.*)")


def _tail(result: subprocess.CompletedProcess, lines: int = 30) -> str:
    return "\n".join((result.stdout + result.stderr).splitlines()[-lines:])


def assert_each_row_once(results: Path, count: int) -> pd.DataFrame:
    """`count` row files, one per point key, every one whole and ok, no temporary left behind."""
    files = sorted(results.glob("*.parquet"))
    frame = pd.read_parquet(results)
    assert len(files) == count and len(frame) == count, [p.name for p in files]
    assert frame.point_key.nunique() == count
    assert (frame.status == "ok").all(), frame[["strategy", "batch", "status", "reason"]].to_string()
    assert not list(results.glob(".*.tmp-*"))
    return frame


def sweep_folder(results: Path) -> Path:
    """The one folder a command line's sweep logs to, <results_dir>/_hydra/multirun/<run>/."""
    folders = [p for p in (results / "_hydra" / "multirun").iterdir() if p.is_dir()]
    assert len(folders) == 1, folders
    return folders[0]


def job_spans(sweep: Path) -> list[tuple[datetime, datetime]]:
    """(start, end) of each submitit job of the sweep, from its logs (submitit's lines go to stdout or stderr)."""
    spans = []
    for job in sorted(p for p in sweep.glob(".submitit/*") if p.is_dir() and p.name[:1].isdigit()):
        times = {}
        lines = [line for log in sorted(job.glob("*_log.*")) for line in log.read_text().splitlines()]
        for line in lines:
            match = SUBMITIT_TIME.match(line)
            if match:
                times.setdefault(match[2].split(" ")[0], datetime.strptime(match[1], "%Y-%m-%d %H:%M:%S,%f"))
        spans.append((times["Starting"], times["Exiting"]))
    return sorted(spans)


def start_sweep(*args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "HYDRA_FULL_ERROR": "0"}
    return subprocess.Popen([sys.executable, "-m", "harness.run", *args], cwd=REPO_ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)


def kill_group(sweep: subprocess.Popen) -> None:
    try:
        os.killpg(sweep.pid, signal.SIGKILL)
    except ProcessLookupError:  # it had ended, and its children with it
        pass
    sweep.wait()


def wait_for(condition, what: str, timeout: float = 45, sweep: subprocess.Popen | None = None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = condition()
        if found:
            return found
        if sweep is not None and sweep.poll() is not None:
            pytest.fail(f"the sweep ended (exit {sweep.returncode}) before {what}:\n{sweep.stdout.read()}")
        time.sleep(0.05)
    pytest.fail(f"no {what} after {timeout:.0f} s")


def test_each_launcher_plans_every_point_once(results_dir):
    """The fast tier's check of the launcher configs: each composes, and a sweep through it is planned
    point by point as the basic launcher's is (the sweeps themselves run in the slow tier)."""
    from harness.run.plan import plan

    for launcher in ("local", "slurm"):
        jobs = plan(["-m", f"hydra/launcher={launcher}", *POINTS, f"results_dir={results_dir}"],
                    cuda_available=lambda: False).planned
        assert len(jobs) == 4 and len({job.point.label() for job in jobs}) == 4, launcher


@pytest.mark.slow
def test_local_launcher_runs_each_group_once_one_at_a_time(results_dir):
    # Three groups of two points (each job a process that imports torch): enough to see one-at-a-time twice.
    points = [arg.replace("strategy=contiguous,no_cache", "strategy=contiguous,paged").replace("batch=1,2", "batch=1,2,3")
              for arg in POINTS]
    result = run_cli("-m", "hydra/launcher=local", *points, *QUICK, f"results_dir={results_dir}", timeout=200)
    assert result.returncode == 0, _tail(result)
    frame = assert_each_row_once(results_dir, 6)
    assert (frame.hostname == socket.gethostname()).all()
    assert (frame.sweep_parallelism == 1).all()  # each group timed alone, and its rows say so
    assert frame.groupby("batch").group_id.nunique().eq(1).all()  # each batch's two points timed together
    sweep = sweep_folder(results_dir)
    # one job per group, plus one per group whose window was slow beside the others (measured again)
    jobs = 3 + len(re.findall(r"group [0-9a-f]+: measuring again", result.stdout + result.stderr))
    assert sorted((p.name for p in sweep.iterdir() if p.name.isdigit()), key=int) == [str(i) for i in range(jobs)]
    spans = job_spans(sweep)
    assert len(spans) == jobs  # one submitit job per group (none idle), each logged under the sweep's folder
    assert all(end <= next_start for (_, end), (next_start, _) in zip(spans, spans[1:])), spans  # one at a time
    # The parent measured nothing itself: its closing line counts what landed in the folder.
    output = result.stdout + result.stderr
    assert "6 point(s) in" in output and ": 6 ok." in output, _tail(result)
    assert f"Report: python -m harness.report results_dir={results_dir}" in output
    assert "Launching" not in output  # the launcher's per-job lines are off without hydra.verbose


@pytest.mark.slow
def test_a_local_sweep_killed_mid_flight_leaves_whole_rows_and_the_rerun_completes(results_dir):
    args = ["-m", "hydra/launcher=local", "model=tiny", "strategy=contiguous", "batch=1,2", "ctx=16",
            "decode_tokens=4", "device=cpu", *QUICK, f"results_dir={results_dir}"]
    sweep = start_sweep(*args)
    try:
        wait_for(lambda: list(results_dir.glob("*.parquet")), "first row", sweep=sweep)
    finally:
        kill_group(sweep)  # the sweep, submitit's controller and the running job
    first = {p.name: p.stat().st_mtime_ns for p in results_dir.glob("*.parquet")}
    assert len(first) == 1 and len(pd.read_parquet(results_dir)) == 1  # only the whole row of the first point
    rerun = run_cli(*args, timeout=120)
    assert rerun.returncode == 0, _tail(rerun)
    assert_each_row_once(results_dir, 2)
    assert all(results_dir.joinpath(name).stat().st_mtime_ns == mtime for name, mtime in first.items())


def _slurm_unavailable() -> str | None:
    missing = [tool for tool in ("sbatch", "sinfo", "squeue", "scancel") if shutil.which(tool) is None]
    if missing:
        return f"no Slurm here ({', '.join(missing)} not on PATH); .ci/slurm.sh starts a one-node cluster"
    try:
        answer = subprocess.run(["sinfo", "--noheader", "--format=%a %t"], capture_output=True, text=True, timeout=20)
    except subprocess.TimeoutExpired:
        return "sinfo did not answer in 20 s"
    if answer.returncode != 0:
        return f"sinfo fails: {(answer.stderr or answer.stdout).strip().splitlines()[:1]}"
    if not any(line.split()[:1] == ["up"] and "down" not in line for line in answer.stdout.splitlines()):
        return f"no partition of this Slurm is up with a node that answers: {answer.stdout.strip()!r}"
    return None


SLURM_UNAVAILABLE = _slurm_unavailable()
REQUIRE_SLURM = os.environ.get("HARNESS_REQUIRE_SLURM") == "1"  # .ci/slurm.sh: a cluster that does not answer fails


@pytest.mark.slow
@pytest.mark.skipif(SLURM_UNAVAILABLE is not None and not REQUIRE_SLURM, reason=str(SLURM_UNAVAILABLE))
def test_slurm_sweep_lands_each_row_once_and_a_cancelled_job_is_measured_on_the_rerun(results_dir):
    if SLURM_UNAVAILABLE is not None:
        pytest.fail(f"HARNESS_REQUIRE_SLURM=1 but {SLURM_UNAVAILABLE}")
    name = f"harness-test-{uuid.uuid4().hex[:8]}"  # this test's jobs among whatever else the cluster runs
    args = ["-m", "hydra/launcher=slurm", f"hydra.launcher.name={name}", "hydra.launcher.array_parallelism=1",
            "hydra.launcher.timeout_min=5", "model=tiny", "strategy=contiguous", "batch=1,2", "ctx=16",
            "decode_tokens=4", "device=cpu", *QUICK, f"results_dir={results_dir}"]

    def finished_jobs():  # submitit's folder of a job is named by its Slurm id (<array>_<task> in an array)
        return {p.parent.name for p in results_dir.glob("_hydra/multirun/*/.submitit/*/*_result.pkl")}

    def running_other_job(done):
        listed = subprocess.run(["squeue", "--noheader", "--array", f"--name={name}", "--states=RUNNING",
                                 "--format=%i"], capture_output=True, text=True).stdout.split()
        return [job for job in listed if job not in done]

    sweep = start_sweep(*args)
    try:
        done = wait_for(finished_jobs, "first job finished", sweep=sweep)
        job = wait_for(lambda: running_other_job(done), "second job running", sweep=sweep)[0]
        subprocess.run(["scancel", job], check=True)  # the job dies before its point's row is written
        output, _ = sweep.communicate(timeout=90)
    finally:
        kill_group(sweep)
        subprocess.run(["scancel", f"--name={name}"], capture_output=True)
    assert sweep.returncode != 0, output  # submitit saw the job end without a result
    assert "sacct error" not in output, output
    first = {p.name: p.stat().st_mtime_ns for p in results_dir.glob("*.parquet")}
    assert len(first) == 1 and len(pd.read_parquet(results_dir)) == 1
    rerun = run_cli(*args, timeout=120)
    assert rerun.returncode == 0, _tail(rerun)
    assert "sacct error" not in rerun.stdout + rerun.stderr
    assert_each_row_once(results_dir, 2)
    assert all(results_dir.joinpath(name).stat().st_mtime_ns == mtime for name, mtime in first.items())
    assert len(list(results_dir.glob("_hydra/multirun/*/.submitit/*/*_result.pkl"))) >= 2  # jobs that finished

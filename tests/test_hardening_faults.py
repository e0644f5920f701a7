"""Hardening, the run side: one definition of a finished point (a row that reads; failed and
other-code rows re-run) and faults that end in one line while what was written stays whole (a full
disk, Ctrl-C, two calibrations at once, a calibration budget). Every test fails on the behaviour
before the fix."""
from __future__ import annotations

import errno
import io
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pyarrow.parquet as pq
import pytest
import torch

from harness.run.plan import plan
from harness.store.files import finished_rows
from tests.conftest import REPO_ROOT

from tests.hardening_helpers import (  # noqa: F401 (tmpfs: a fixture)
    NO_CUDA, TINY, FAST, finished_row, fake_calibration, seeded, cli, only_line, planned, plant_row, MOUNTABLE, tmpfs,
)


# --- 3. A finished point is one whose row reads ---------------------------------------------------


def test_a_truncated_or_two_row_file_is_not_finished(tmp_path):
    point = planned()[0].point
    path = plant_row(tmp_path, point)
    assert finished_row(tmp_path, point.key).status == "ok" and point.key in finished_rows(tmp_path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    assert finished_row(tmp_path, point.key) is None and point.key not in finished_rows(tmp_path)
    path.write_bytes(b"")
    assert finished_row(tmp_path, point.key) is None
    import pyarrow as pa
    table = pq.read_table(io.BytesIO(data))
    pq.write_table(pa.concat_tables([table, table]), path)
    assert finished_row(tmp_path, point.key) is None


@pytest.mark.parametrize("model", ["m" * 400, "模" * 200])
def test_a_row_of_a_model_named_longer_than_a_file_name_is_written_and_found_by_its_key(tmp_path, model):
    """A checkpoint's name becomes the row's `model`: a long one still gives a file name within 255
    bytes (cut at whole characters), and the point is finished by its key."""
    from harness.run.row import build_row
    from harness.store.files import write_row

    point = planned()[0].point
    path = write_row(tmp_path, {**build_row(point, {"status": "ok", "reason": None}), "model": model})
    assert len(path.name.encode()) <= 255 and path.name.endswith(f"__{point.key}.parquet")
    assert finished_row(tmp_path, point.key).status == "ok" and point.key in finished_rows(tmp_path)


@pytest.mark.slow  # through the CLI; the rule itself, in process: the test above
def test_a_truncated_row_is_measured_again(tmp_path):
    results = seeded(tmp_path / "results")
    point = planned(f"results_dir={results}", "isolate=false")[0].point
    path = plant_row(results, point)
    path.write_bytes(path.read_bytes()[:1000])
    result = cli(*FAST, f"results_dir={results}")
    assert result.returncode == 0, result.stderr
    assert "already measured" not in result.stdout + result.stderr
    assert pq.read_table(path).column("status").to_pylist() == ["ok"]


def test_the_thread_count_is_part_of_the_key(tmp_path):
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = planned()[0].point
        torch.set_num_threads(2)
        two = planned()[0].point
    finally:
        torch.set_num_threads(threads)
    assert (one.threads, two.threads) == (1, 2) and one.key != two.key
    probe = ("from tests.conftest import planned_point; p = planned_point('model=tiny', 'ctx=8', 'decode_tokens=2'); "
             "print(p.threads, p.key)")
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", probe], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == ["1", one.key] and one.key != two.key


def fake_cfg(**keys):
    return SimpleNamespace(**{"overwrite": False, "rerun_failed": True, "rerun_other_code": False, **keys})


def test_rerun_rules():
    from harness.run.execute import rerun_reason
    from harness.run.metadata import git_commit
    from harness.store.files import FinishedRow

    here, other = git_commit(), "0" * 40
    ok = FinishedRow(Path("x"), "ok", here)
    failed = FinishedRow(Path("x"), "failed", here)
    foreign = FinishedRow(Path("x"), "ok", other)
    assert rerun_reason(ok, fake_cfg()) is None
    assert "failed" in rerun_reason(failed, fake_cfg())
    assert rerun_reason(failed, fake_cfg(rerun_failed=False)) is None
    assert rerun_reason(foreign, fake_cfg()) is None
    assert "other code" in rerun_reason(foreign, fake_cfg(rerun_other_code=True))
    assert rerun_reason(ok, fake_cfg(overwrite=True)) == "overwrite=true"
    # A slow window killed while measured again left its rows flagged: the next run measures them again.
    from harness.run.windows import REMEASURING
    pending = FinishedRow(Path("x"), "ok", here, f"spread; {REMEASURING}")
    assert "slow window" in rerun_reason(pending, fake_cfg())


def two_failed_rows(tmp_path):
    results = seeded(tmp_path / "results")
    one, two = (j.point for j in plan(["-m", *FAST, "batch=1,2", f"results_dir={results}"], cuda_available=NO_CUDA).planned)
    plant_row(results, one, "failed")
    plant_row(results, two, "failed")
    return results, one, two


@pytest.mark.slow  # a rerun rule through the CLI: the slow tier (the rules themselves: test_rerun_rules)
def test_failed_rows_are_measured_again_by_default_and_the_closing_line_counts_them(tmp_path):
    results, one, two = two_failed_rows(tmp_path)
    rerun = cli("-m", *FAST, "batch=1", f"results_dir={results}")
    assert rerun.returncode == 0, rerun.stderr
    assert "measuring again: its row failed" in rerun.stdout and "holds 2 rows, 1 failed" in rerun.stdout
    assert finished_row(results, one.key).status == "ok" and finished_row(results, two.key).status == "failed"


@pytest.mark.slow  # a rerun rule through the CLI: the slow tier (the rules themselves: test_rerun_rules)
def test_rerun_failed_false_keeps_failed_rows(tmp_path):
    results, one, _ = two_failed_rows(tmp_path)
    kept = cli("-m", *FAST, "batch=1", "rerun_failed=false", f"results_dir={results}")
    assert kept.returncode == 0, kept.stderr
    assert "failed, kept" in kept.stdout and "holds 2 rows, 2 failed" in kept.stdout
    assert finished_row(results, one.key).status == "failed"


OLD_COMMIT = "0123456789abcdef0123456789abcdef01234567"


def row_of_other_code(tmp_path):
    results = seeded(tmp_path / "results")
    point = planned(f"results_dir={results}", "isolate=false")[0].point
    plant_row(results, point, git_commit=OLD_COMMIT)
    return results, point


@pytest.mark.slow  # a rerun rule through the CLI: the slow tier (the rules themselves: test_rerun_rules)
def test_rows_of_other_code_are_reported_not_measured_again(tmp_path):
    results, point = row_of_other_code(tmp_path)
    reported = cli(*FAST, f"results_dir={results}")
    assert reported.returncode == 0 and "already measured" in reported.stdout
    assert f"made by other code (git_commit {OLD_COMMIT}" in reported.stdout and "1 made by other code" in reported.stdout
    assert finished_row(results, point.key).git_commit == OLD_COMMIT


@pytest.mark.slow  # a rerun rule through the CLI: the slow tier (the rules themselves: test_rerun_rules)
def test_rerun_other_code_measures_them_again(tmp_path):
    results, point = row_of_other_code(tmp_path)
    redo = cli(*FAST, "rerun_other_code=true", f"results_dir={results}")
    assert redo.returncode == 0 and "measuring again: its row was made by other code" in redo.stdout
    assert finished_row(results, point.key).git_commit != OLD_COMMIT


def test_git_commit_counts_untracked_code_and_names_the_dirty_state(tmp_path, monkeypatch):
    from harness.run import metadata

    git = ["git", "-c", "user.email=t@t", "-c", "user.name=t"]
    subprocess.run([*git, "init", "-q", str(tmp_path)], check=True)
    (tmp_path / "a.py").write_text("x = 1\n")
    subprocess.run([*git, "-C", str(tmp_path), "add", "a.py"], check=True)
    subprocess.run([*git, "-C", str(tmp_path), "commit", "-qm", "c"], check=True)
    monkeypatch.setattr(metadata, "REPO_ROOT", tmp_path)
    head = metadata.git_commit.__wrapped__()
    assert "+dirty" not in head
    (tmp_path / "rows.parquet").write_bytes(b"data")  # data is not code
    assert metadata.git_commit.__wrapped__() == head
    (tmp_path / "new_strategy.py").write_text("y = 2\n")  # an untracked module is
    dirty = metadata.git_commit.__wrapped__()
    assert dirty.startswith(head + "+dirty.") and metadata.git_commit.__wrapped__() == dirty
    (tmp_path / "new_strategy.py").write_text("y = 3\n")
    assert metadata.git_commit.__wrapped__() not in (head, dirty)
    assert metadata.same_code(dirty, dirty) and not metadata.same_code(head + "+dirty", head + "+dirty")
    assert not metadata.same_code(head, dirty) and metadata.same_code(None, None)


# --- 5. Faults end in one line, and the rest goes on ----------------------------------------------


def assert_whole(results: Path, written: int) -> None:
    rows = sorted(results.glob("*.parquet"))
    assert len(rows) == written and all(pq.read_table(p).num_rows == 1 for p in rows)
    assert not list(results.glob(".*.tmp-*")) and not list((results / "_calibration").glob(".*tmp*"))


@pytest.mark.slow  # a fault through the CLI: the slow tier
@pytest.mark.skipif(not MOUNTABLE, reason="needs root and mount for a 200 KiB tmpfs (see the simulated test)")
def test_a_full_disk_stops_the_sweep_in_one_line(tmp_path, tmpfs):
    results = seeded(tmpfs(tmp_path / "full", "size=120k"))  # a row is ~55 KB: room for one or two
    result = cli("-m", *FAST, "batch=1,2,3,4,5,6,7,8", f"results_dir={results}")
    assert result.returncode == 3, result.stderr
    line = only_line(result.stderr)
    assert line.startswith("error: results_dir is full after ")
    written = int(line.split("after ")[1].split()[0])
    assert 0 <= written < 8
    assert_whole(results, written)


@pytest.mark.slow  # a fault through the CLI: the slow tier
def test_a_full_disk_simulated_stops_the_sweep_in_one_line(tmp_path):
    results = seeded(tmp_path / "results")
    script = ("import errno, os, sys\n"
              "real, calls = os.fsync, []\n"
              "def fsync(fd):\n"
              "    calls.append(fd)\n"
              "    if len(calls) > 1: raise OSError(errno.ENOSPC, 'No space left on device')\n"
              "    real(fd)\n"
              "os.fsync = fsync\n"
              f"sys.argv = ['harness/run/__main__.py', '-m', *{FAST!r}, 'batch=1,2,3', 'results_dir={results}']\n"
              "from harness.run.app import main\n"
              "sys.exit(main())\n")
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 3, result.stderr
    assert only_line(result.stderr).startswith("error: results_dir is full after 1 rows")
    assert_whole(results, 1)


@pytest.mark.slow  # a fault through the CLI: the slow tier
def test_ctrl_c_prints_one_line_and_exits_130(tmp_path):
    """SIGINT to the process group, as Ctrl-C sends it, a second into the sweep: the runner, its fork
    server (importing torch then) and the point's process all get it."""
    results = seeded(tmp_path / "results")
    args = ["-m", *TINY[:-1], "decode_tokens=300", "batch=1,2,3,4", f"results_dir={results}",  # isolated points
            "hydra.verbose=hydra._internal.core_plugins.basic_launcher"]  # its `Launching` line: the sweep began
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    sweep = subprocess.Popen([sys.executable, "-m", "harness.run", *args], cwd=REPO_ROOT, env=env, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    for line in sweep.stdout:
        if "Launching" in line:
            break
    time.sleep(1.0)
    os.killpg(sweep.pid, signal.SIGINT)
    _, err = sweep.communicate(timeout=60)
    assert sweep.returncode == 130, err
    assert only_line(err).startswith("interrupted: ")
    assert_whole(results, len(list(results.glob("*.parquet"))))


def test_two_processes_never_calibrate_one_device_at_once(tmp_path, caplog):
    from harness.run import calibrate

    running, calls, results = [], [], {}

    def slow_measure(fn, arg):
        assert fn is calibrate.measure_within and arg[:2] == ("cpu", "float32")
        running.append(1)
        assert len(running) == 1, "two calibrations at once"
        calls.append(arg)
        time.sleep(0.5)
        running.pop()
        return fake_calibration(timestamp="2999-01-01T00:00:00+00:00")

    def worker(name):
        results[name] = calibrate.ensure(tmp_path, "cpu", "float32", False, slow_measure, budget_s=30)

    with caplog.at_level(logging.INFO, logger="harness"):
        threads = [threading.Thread(target=worker, args=(n,)) for n in ("first", "second")]
        for t in threads:
            t.start()
            time.sleep(0.1)
        for t in threads:
            t.join()
    assert len(calls) == 1 and calls[0][2] == 30
    assert sorted(measured for _, measured in results.values()) == [False, True]
    assert results["first"][0] == results["second"][0]
    assert "calibrating cpu/float32" in caplog.text and "budget 30 s" in caplog.text
    assert "is calibrating cpu/float32" in caplog.text and "waiting for it" in caplog.text


def test_a_calibration_that_cannot_be_saved_leaves_no_temporary(tmp_path, monkeypatch):
    import harness.files
    from harness.run import calibrate

    def full_disk(descriptor):  # the record's bytes written to the temporary, then the disk is full
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(harness.files.os, "fsync", full_disk)
    with pytest.raises(OSError):
        calibrate.ensure(tmp_path, "cpu", "float32", False, lambda fn, arg: fake_calibration())
    assert [p.name for p in (tmp_path / "_calibration").iterdir()] == [calibrate.lock_path(tmp_path, "cpu", "float32").name]


class FixedTimer:
    def __init__(self, seconds: float):
        self.seconds = seconds

    def time(self, fn):
        return None, self.seconds


def test_the_calibration_gemm_shrinks_to_its_budget():
    from harness.measure.roofs import _gemm_size

    cpu = torch.device("cpu")
    # fp16 on a CPU without fp16 units: 0.08 s for 256^3, so 2048^3 takes 41 s and ten repeats 450 s
    assert _gemm_size(2048, 30.0, cpu, torch.float32, FixedTimer(0.08)) == 1024
    assert _gemm_size(2048, 0.1, cpu, torch.float32, FixedTimer(0.08)) == 256
    assert _gemm_size(2048, 30.0, cpu, torch.float32, FixedTimer(1e-4)) == 2048


def test_a_calibration_within_a_small_budget_records_what_it_did():
    from harness.run.calibrate import measure_within

    began = time.monotonic()
    record = measure_within(("cpu", "float32", 0.2, True))
    assert time.monotonic() - began < 8
    assert record.read_bandwidth_Bps > 0 and record.matmul_flops > 0
    assert "of a 0.2 s budget" in record.method and "timed runs: read kernels" in record.method
    assert "shrunk from 2048" in record.method


def test_a_point_that_does_not_fit_leaves_kernel_null(tmp_path):
    """In a sweep (-m) the plan keeps such a point and the runner writes its skipped row, measuring nothing."""
    from harness.run.execute import RunContext, measure_planned
    from harness.run.plan import plan

    results = seeded(tmp_path / "results")
    (job,) = plan(["-m", *FAST, f"batch={2**30}", f"results_dir={results}"], cuda_available=NO_CUDA).planned
    measure_planned(RunContext(), job)
    (row,) = pq.read_table(results).to_pylist()
    assert row["status"] == "skipped" and "does not fit" in row["reason"] and row["kernel"] is None



"""The runner end to end: rows, resume, kills, failures, memory isolation, the Parquet schema."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pyarrow.parquet as pq
import pytest

from harness.store.columns import COLUMN_NAMES, SCHEMA
from tests.conftest import QUICK_CALIBRATION, REPO_ROOT, SHARED_SWEEP, SHARED_SWEEP_POINTS, copy_sweep, run_cli
from tests.hardening_helpers import seeded


# The rows of the session's sweep (tests/conftest.py, tiny_sweep): the runner with isolated points, a real
# calibration, a skipped strategy and one from tests/plugin/.
def test_one_row_per_point_readable_with_pandas(tiny_sweep):
    frame = pd.read_parquet(tiny_sweep.results)
    assert len(frame) == SHARED_SWEEP_POINTS and list(frame.columns) == COLUMN_NAMES
    assert set(frame.status) == {"ok", "skipped"}
    assert (frame[frame.strategy == "flash"].status == "skipped").all()
    assert frame[frame.strategy == "flash"].reason.str.contains("runs on cuda").all()
    assert frame[frame.status == "ok"].kernel.notna().all()


def test_every_file_has_the_schema(tiny_sweep):
    for path in tiny_sweep.results.glob("*.parquet"):
        assert pq.read_schema(path).remove_metadata().equals(SCHEMA)


def test_strategies_agree_token_for_token_through_the_runner(tiny_sweep):
    frame = pd.read_parquet(tiny_sweep.results)
    ok = frame[frame.status == "ok"]
    digests = ok.groupby(["batch", "ctx"]).tokens_digest.nunique()
    assert (digests == 1).all() and len(digests) == 2


def test_contiguous_cache_bytes_are_exact(tiny_sweep):
    frame = pd.read_parquet(tiny_sweep.results)
    rows = frame[frame.strategy == "contiguous"]
    expected = 2 * rows.n_layers * rows.n_kv_heads * rows.head_dim * 4 * rows.batch * (rows.ctx + rows.decode_tokens)
    assert (rows.kv_cache_bytes == expected).all()
    assert (frame[frame.strategy == "no_cache"].kv_cache_bytes == 0).all()


def test_progress_names_point_i_of_n(tiny_sweep):
    n = SHARED_SWEEP_POINTS
    assert "[1/%d]" % n in tiny_sweep.log and "[%d/%d]" % (n, n) in tiny_sweep.log and "left)" in tiny_sweep.log


@pytest.mark.slow  # two more runs through the CLI (the rerun rules in process: tests/test_hardening_faults.py)
def test_rerun_skips_finished_points_unless_overwrite(tiny_sweep, tmp_path):
    results = copy_sweep(tiny_sweep, tmp_path / "results")
    before = {p.name: p.stat().st_mtime_ns for p in results.glob("*.parquet")}
    again = run_cli(*SHARED_SWEEP, f"results_dir={results}")
    assert again.returncode == 0 and f"{SHARED_SWEEP_POINTS} already measured" in again.stdout + again.stderr
    assert {p.name: p.stat().st_mtime_ns for p in results.glob("*.parquet")} == before
    redo = run_cli("device=cpu", "model=tiny", "batch=2", "ctx=16", "decode_tokens=4", "strategy=contiguous",
                   "overwrite=true", f"results_dir={results}")
    assert redo.returncode == 0
    after = {p.name: p.stat().st_mtime_ns for p in results.glob("*.parquet")}
    assert len(after) == SHARED_SWEEP_POINTS and sum(after[n] != before[n] for n in after) == 1


def test_a_failing_point_is_recorded_and_the_sweep_goes_on(results_dir):
    result = run_cli("-m", "device=cpu", "model=tiny", "decode_tokens=4", "ctx=8", "batch=1,2", "isolate=false",
                     "strategy._target_=tests.failing.ExplodingStrategy", f"results_dir={seeded(results_dir)}")
    assert result.returncode == 1  # the sweep finished, and says some point failed
    frame = pd.read_parquet(results_dir)
    assert len(frame) == 2 and (frame.status == "failed").all()
    assert frame.reason.str.contains("kernel error planted by the test").all()


@pytest.mark.slow
def test_sigkill_leaves_whole_rows_and_the_rerun_completes(results_dir):
    args = ["-m", "device=cpu", "model=tiny", "strategy=no_cache,contiguous", "batch=1,2", "ctx=8,16", "decode_tokens=40",
            QUICK_CALIBRATION, f"results_dir={results_dir}"]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    sweep = subprocess.Popen([sys.executable, "-m", "harness.run", *args], cwd=REPO_ROOT, env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 120
    while len(list(results_dir.glob("*.parquet"))) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    os.killpg(sweep.pid, signal.SIGKILL)  # the sweep and its point processes, mid-flight
    sweep.wait()
    first = {p.name: p.stat().st_mtime_ns for p in results_dir.glob("*.parquet")}
    assert 3 <= len(first) < 8
    assert len(pd.read_parquet(results_dir)) == len(first)  # only whole rows are visible
    rerun = run_cli(*args)
    assert rerun.returncode == 0, rerun.stderr
    final = {p.name: p.stat().st_mtime_ns for p in results_dir.glob("*.parquet")}
    assert len(final) == 8 and all(final[name] == mtime for name, mtime in first.items())
    assert not list(results_dir.glob(".*.tmp-*"))


@pytest.mark.slow
def test_a_runner_killed_alone_leaves_no_group_measuring(results_dir):
    """SIGKILL to the runner only (not its process group): its fork server sees it gone and exits, and
    the group's process, whose parent that server is, ends with it instead of measuring on."""
    mark = f"harness-orphan-test-{os.getpid()}-{time.monotonic_ns()}"
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "HARNESS_TEST_MARK": mark}
    sweep = subprocess.Popen([sys.executable, "-m", "harness.run", "device=cpu", "model=tiny", "strategy=contiguous",
                              "ctx=16", "decode_tokens=100000", QUICK_CALIBRATION, f"results_dir={results_dir}"],
                             cwd=REPO_ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             start_new_session=True)

    def marked() -> set[int]:  # processes of this test's run, by the variable every one inherits
        found = set()
        for entry in Path("/proc").iterdir():
            try:
                if entry.name.isdigit() and mark.encode() in (entry / "environ").read_bytes():
                    found.add(int(entry.name))
            except OSError:  # gone meanwhile, or not ours to read
                pass
        return found

    try:
        deadline = time.monotonic() + 120
        # The runner, its resource tracker and fork server, and one child of the server, the same for 3 s:
        # the group measuring (the calibration's child, before it, lasts about calibration_budget_s).
        seen, since = set(), time.monotonic()
        while time.monotonic() < deadline and not (len(seen) >= 4 and time.monotonic() - since > 3):
            now = marked()
            seen, since = (seen, since) if now == seen else (now, time.monotonic())
            time.sleep(0.1)
        assert len(seen) >= 4, "the group's process never started"
        sweep.kill()
        sweep.wait()
        deadline = time.monotonic() + 30
        while marked() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not marked(), f"left running after the runner was killed: {sorted(marked())}"
    finally:
        for pid in marked():
            os.kill(pid, signal.SIGKILL)


@pytest.mark.slow
def test_a_small_point_after_a_large_one_shows_its_own_peak(results_dir):
    # Large: 256 sequences x 1040 tokens x 512 B/token = 136 MB of cache. Small: 1 x 20 tokens.
    result = run_cli("-m", "device=cpu", "model=tiny", "strategy=contiguous", "batch=256,1", "ctx=1024,16", "decode_tokens=4",
                     QUICK_CALIBRATION, f"results_dir={results_dir}")
    assert result.returncode == 0, result.stderr
    frame = pd.read_parquet(results_dir).set_index(["batch", "ctx"])
    large, small = frame.loc[(256, 1024)], frame.loc[(1, 16)]
    assert large.kv_cache_bytes > 100e6
    assert large.peak_memory_bytes >= large.kv_cache_bytes
    assert small.peak_memory_bytes < large.peak_memory_bytes - 0.8 * large.kv_cache_bytes

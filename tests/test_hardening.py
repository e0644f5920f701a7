"""Hardening of the three command lines (runner, analytic CLI, report), one section per class of the
adversarial pass: bounded values, output where the user said, one definition of a finished point,
names that do not lie, faults in one line, closed-form analytic figures. Every test here fails on the
behaviour before the fix. CLI runs use model=tiny, a tiny ctx and decode_tokens, isolate=false where
the process isolation is not what is tested, and a planted calibration record (no 5 s calibration)."""
from __future__ import annotations

import errno
import io
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from types import SimpleNamespace

import pyarrow.parquet as pq
import pytest
import torch

from harness.config.validate import INT64_MAX, ConfigError
from harness.measure.point import not_run
from harness.run.plan import plan
from harness.run.row import build_row
from harness.store.calibration import Calibration, save
from harness.store.files import finished_keys, write_row
from strategies.contiguous import ContiguousStrategy
from tests.conftest import REPO_ROOT

NO_CUDA = lambda: False  # noqa: E731
TINY = ["device=cpu", "model=tiny", "ctx=8", "decode_tokens=2"]
FAST = [*TINY, "isolate=false"]


def finished_row(results_dir, key):
    from harness.store.files import finished_row as row_of

    return row_of(results_dir, key)


def fake_calibration(device: str = "cpu", dtype: str = "float32", timestamp: str = "2024-01-01T00:00:00+00:00"):
    return Calibration(device=device, device_name="test cpu", hostname=socket.gethostname(), dtype=dtype,
                       read_bandwidth_Bps=1e10, read_bandwidth_sum_Bps=1e10, read_bandwidth_gemv_Bps=1e10,
                       read_bandwidth_packed_gemv_Bps=None, matmul_flops=1e11, timestamp=timestamp, method="planted")


def seeded(results_dir: Path) -> Path:
    """A results folder with a calibration record, so a run measures no roofs."""
    save(results_dir, fake_calibration())
    return results_dir


def cli(*args: str, module: str = "harness.run", timeout: float = 120, cwd=REPO_ROOT, **env) -> subprocess.CompletedProcess:
    """`python -m <module> args...` with the pytest process's thread count (so its points have the keys
    the in-process plan gives them) and extra environment variables."""
    full_env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "HYDRA_FULL_ERROR": "0",
                "OMP_NUM_THREADS": str(torch.get_num_threads()), **env}
    return subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, env=full_env, capture_output=True,
                          text=True, timeout=timeout)


def only_line(stderr: str) -> str:
    lines = [line for line in stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    assert "Traceback" not in stderr
    return lines[0]


def refusal(*overrides: str) -> str:
    with pytest.raises(ConfigError) as refused:
        plan(["device=cpu", "model=tiny", *overrides], cuda_available=NO_CUDA)
    message = str(refused.value)
    assert "\n" not in message, message
    return message


def planned(*overrides: str):
    return plan([*TINY, *overrides], cuda_available=NO_CUDA).jobs


def plant_row(results_dir: Path, point, status: str = "ok", git_commit: str | None = None) -> Path:
    """A row of `point` as the runner would write it, without measuring."""
    measured = {"status": status, "reason": f"planted {status}"}
    row = build_row(point, measured)
    if git_commit is not None:
        row["git_commit"] = git_commit
    return write_row(results_dir, row)


def can_mount() -> bool:
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    probe = Path(f"/tmp/.harness-mount-probe-{os.getpid()}")
    probe.mkdir(exist_ok=True)
    try:
        ok = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(probe)], capture_output=True).returncode == 0
        if ok:
            subprocess.run(["umount", str(probe)], check=True)
        return ok
    finally:
        probe.rmdir()


MOUNTABLE = can_mount()


@pytest.fixture
def tmpfs():
    """mount(path, options): a tmpfs at path, unmounted after the test (root only)."""
    mounted = []

    def mount(path: Path, options: str) -> Path:
        path.mkdir(parents=True, exist_ok=True)
        subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], check=True)
        mounted.append(path)
        return path

    yield mount
    for path in reversed(mounted):
        subprocess.run(["umount", "-l", str(path)], check=False)


# --- 1. Every value is checked before anything runs, and bounded ---------------------------------


@pytest.mark.parametrize("overrides,key", [
    (["seed=1180591620717411303424"], "seed"),
    ([f"seed={2**64}"], "seed"),
    ([f"seed={INT64_MAX + 1}"], "seed"),
    (["model.name=a/b"], "model.name"),
    (["model.name=.hidden"], "model.name"),
    (["strategy._target_=nosuch.Klass"], "strategy._target_"),
    (["strategy._target_=os.path"], "strategy._target_"),
    (["strategy._target_=not-a-path"], "strategy._target_"),
    (["strategy=paged", f"strategy.block_size={2**63}"], "strategy.block_size"),  # an option: int64 too
    (["strategy=paged", "strategy.block_size=1e400"], "strategy.block_size"),  # inf: JSON has none
    (["-m", f"batch=1,{2**62}"], "batch"),  # fits int64, its row's cache bytes would not
    ([f"model.vocab_size={2**31 - 1}", f"model.d_model={2**31 - 2}", "model.head_dim=2"], "model"),  # weight_bytes
    (["-m", "model=glob(*)"], "model"),  # the glob also matches model_schema
    (["calibration_budget_s=0"], "calibration_budget_s"),
    (["calibration_budget_s=nan"], "calibration_budget_s"),
])
def test_a_value_that_cannot_be_written_is_refused_by_the_plan(overrides, key):
    assert refusal(*overrides).startswith(f"{key}:")


def test_a_bad_target_is_one_line_without_hydras_logged_error(caplog):
    with caplog.at_level(logging.DEBUG):
        message = refusal("strategy._target_=nosuch.Klass")
    assert message == "strategy._target_: cannot import 'nosuch.Klass': ModuleNotFoundError: No module named 'nosuch'"
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text


class SlashNamed(ContiguousStrategy):  # a strategy whose declared name cannot be part of a file name
    name = "a/b"


def test_a_strategy_name_that_reaches_a_file_name_is_checked():
    message = refusal("strategy._target_=tests.test_hardening.SlashNamed")
    assert message.startswith("strategy._target_:") and "'a/b'" in message


def test_glob_sweeps_expand_like_hydra():
    jobs = plan(["-m", *TINY, "model=glob(tiny)"], cuda_available=NO_CUDA).jobs
    assert [j.point.model.name for j in jobs] == ["tiny"]
    jobs = plan(["-m", *TINY, "strategy=glob(no_*)"], cuda_available=NO_CUDA).jobs
    assert len(jobs) == 1 and jobs[0].point.strategy.strategy_class.endswith("NoCacheStrategy")


def test_the_largest_int64_seed_runs_and_writes(tmp_path):
    from harness.measure.point import measure_point

    point = planned(f"seed={INT64_MAX}")[0].point
    row = build_row(point, measure_point(point))
    assert row["status"] == "ok" and row["seed"] == INT64_MAX
    assert pq.read_table(write_row(tmp_path, row)).num_rows == 1


def analytic(*args: str) -> tuple[int, str, str]:
    from harness.analysis.cli import main

    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = main(list(args))
    return code, out.getvalue(), err.getvalue()


@pytest.mark.parametrize("args,key", [
    (["hardware.bandwidth_Bps=0"], "hardware.bandwidth_Bps"),  # was a ZeroDivisionError
    (["hardware.bandwidth_Bps=-1"], "hardware.bandwidth_Bps"),  # was a negative ridge, exit 0
    (["hardware.bandwidth_Bps=1e-300"], "hardware.bandwidth_Bps"),  # was an OverflowError
    (["hardware.flops.bfloat16=nan"], "hardware.flops.bfloat16"),
    (["hardware.flops.bfloat16=1e30"], "hardware.flops.bfloat16"),
    (["model=tiny", "model.d_model=66"], "model.d_model"),  # was head_dim rounded silently
    (["batch=99999999999999999999"], "batch"),
    (["strategy=paged", "strategy.block_size=1e400"], "strategy.block_size"),
    (["strategy._target_=nosuch.Klass"], "strategy._target_"),
    (["results_dir=", "hardware=measured"], "results_dir"),
])
def test_analytic_cli_refuses_in_one_line(args, key):
    code, out, err = analytic(*args)
    assert code == 2 and out == ""
    assert only_line(err).startswith(f"{key}:")


def test_runner_and_analytic_cli_refuse_the_same_shape_alike():
    _, _, err = analytic("model=tiny", "model.d_model=66")
    assert refusal("model.d_model=66") == err.strip()


# --- 2. Output goes where the user said, or nowhere -----------------------------------------------


def test_output_folder_refuses_empty_file_under_file(tmp_path):
    from harness.config.validate import output_folder

    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    for value, expected in [("", "is empty"), ("  ", "is empty"), (str(a_file), "is a file"),
                            (str(a_file / "below"), "under the file")]:
        with pytest.raises(ConfigError, match=expected):
            output_folder("results_dir", value)
    assert output_folder("results_dir", str(tmp_path / "new" / "deeper")) == tmp_path / "new" / "deeper"
    assert not (tmp_path / "new").exists()  # nothing created by the check


@pytest.fixture
def read_only_dir(tmp_path, tmpfs):
    path = tmp_path / "ro"
    if MOUNTABLE:
        return tmpfs(path, "ro,size=64k")
    if os.geteuid() == 0:
        pytest.skip("root without mount: no folder is read-only to root")
    path.mkdir()
    path.chmod(0o555)
    return path


def test_a_read_only_results_dir_is_refused(read_only_dir):
    assert refusal(f"results_dir={read_only_dir}").startswith("results_dir:")
    assert "read-only" in refusal(f"results_dir={read_only_dir}/sub")


@pytest.mark.parametrize("hydra_key", ["hydra.run.dir=/tmp/elsewhere", "hydra.sweep.dir=/tmp/elsewhere",
                                       "hydra.job.chdir=true", "hydra.output_subdir=/tmp/x",
                                       "hydra.sweep.subdir=../../x", "hydra.job.name=../x",
                                       "hydra/job_logging=disabled", "hydra.job_logging.handlers.file.filename=/x.log"])
def test_hydra_keys_that_move_output_are_refused(hydra_key):
    key = hydra_key.split("=")[0]
    assert refusal(hydra_key).startswith(f"{key}:")


def test_a_preset_that_moves_hydras_output_is_refused(tmp_path):
    (tmp_path / "sweep").mkdir()
    (tmp_path / "sweep" / "moved.yaml").write_text("# @package _global_\nhydra:\n  run:\n    dir: /tmp/elsewhere\n")
    message = refusal(f"hydra.searchpath=[file://{tmp_path}]", "+sweep=moved")
    assert message.startswith("hydra.run.dir:")


def test_results_dir_is_one_folder_per_command_line():
    assert refusal("-m", "results_dir=a,b").startswith("results_dir:")


def test_flags_that_pick_another_config_are_refused():
    for flag in (["--config-name=other"], ["-cn", "other"], ["--config-dir=/tmp"], ["--experimental-rerun=x"]):
        assert refusal(*flag).startswith("command line:")


def test_a_launcher_needs_an_absolute_results_dir(tmp_path):
    assert refusal("hydra/launcher=basic").startswith("results_dir:")
    assert planned("hydra/launcher=basic", f"results_dir={tmp_path}")


def test_hydras_run_folder_is_unique_per_process():
    from hydra import compose, initialize_config_dir

    from harness.run.plan import CONFIG_DIR, run_id

    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose(config_name="config", return_hydra_config=True)
        run_dir, sweep_dir = str(cfg.hydra.run.dir), str(cfg.hydra.sweep.dir)
    assert run_dir.endswith(run_id()) and sweep_dir.endswith(run_id()) and str(os.getpid()) in run_id()


@pytest.mark.parametrize("args", [["results_dir="], ["results_dir=   "], ["hydra.run.dir=/tmp/harness-elsewhere"],
                                  ["hydra.job.chdir=true"], ["-m", "model=glob(*)"], [f"seed={2**64}"]])
def test_runner_cli_refuses_in_one_line_and_writes_nothing(tmp_path, args):
    before = set(os.listdir("/"))
    result = cli(*FAST, *args, cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert only_line(result.stderr).startswith("error: ")
    assert not list(tmp_path.iterdir()) and set(os.listdir("/")) == before


@pytest.mark.parametrize("below", [False, True])
def test_results_dir_naming_a_file_is_one_line(tmp_path, below):
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    result = cli(*FAST, f"results_dir={a_file / 'below' if below else a_file}")
    assert result.returncode == 2 and only_line(result.stderr).startswith("error: results_dir:")
    assert sorted(tmp_path.iterdir()) == [a_file] and a_file.read_text() == "x"


def report(*args: str) -> tuple[int, str, str]:
    from harness.report.__main__ import main

    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = main(list(args))
    return code, out.getvalue(), err.getvalue()


def test_report_out_goes_where_said_or_nowhere(tmp_path, read_only_dir):
    results = tmp_path / "results"
    results.mkdir()
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    for args, key in [(["results_dir="], "results_dir"), ([f"results_dir={a_file}"], "results_dir"),
                      ([f"results_dir={results}", "out="], "out"), ([f"results_dir={results}", f"out={a_file}"], "out"),
                      ([f"results_dir={results}", f"out={a_file}/x"], "out"),
                      ([f"results_dir={results}", f"out={read_only_dir}"], "out")]:
        code, _, err = report(*args)
        assert code == 2 and only_line(err).startswith(f"{key}:"), (args, err)
    assert not list(results.iterdir()) and a_file.read_text() == "x"


# --- 3. A finished point is one whose row reads ---------------------------------------------------


def test_a_truncated_or_two_row_file_is_not_finished(tmp_path):
    point = planned()[0].point
    path = plant_row(tmp_path, point)
    assert finished_row(tmp_path, point.key).status == "ok" and point.key in finished_keys(tmp_path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    assert finished_row(tmp_path, point.key) is None and point.key not in finished_keys(tmp_path)
    path.write_bytes(b"")
    assert finished_row(tmp_path, point.key) is None
    import pyarrow as pa
    table = pq.read_table(io.BytesIO(data))
    pq.write_table(pa.concat_tables([table, table]), path)
    assert finished_row(tmp_path, point.key) is None


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
    from harness.run.app import rerun_reason
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


def two_failed_rows(tmp_path):
    results = seeded(tmp_path / "results")
    one, two = (j.point for j in plan(["-m", *FAST, "batch=1,2", f"results_dir={results}"], cuda_available=NO_CUDA).jobs)
    plant_row(results, one, "failed")
    plant_row(results, two, "failed")
    return results, one, two


def test_failed_rows_are_measured_again_by_default_and_the_closing_line_counts_them(tmp_path):
    results, one, two = two_failed_rows(tmp_path)
    rerun = cli("-m", *FAST, "batch=1", f"results_dir={results}")
    assert rerun.returncode == 0, rerun.stderr
    assert "measuring again: its row failed" in rerun.stdout and "holds 2 rows, 1 failed" in rerun.stdout
    assert finished_row(results, one.key).status == "ok" and finished_row(results, two.key).status == "failed"


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


def test_rows_of_other_code_are_reported_not_measured_again(tmp_path):
    results, point = row_of_other_code(tmp_path)
    reported = cli(*FAST, f"results_dir={results}")
    assert reported.returncode == 0 and "already measured" in reported.stdout
    assert f"made by other code (git_commit {OLD_COMMIT}" in reported.stdout and "1 made by other code" in reported.stdout
    assert finished_row(results, point.key).git_commit == OLD_COMMIT


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


# --- 4. A name never lies ----------------------------------------------------------------------


def test_the_rows_strategy_comes_from_the_class():
    assert refusal("strategy=flash", "strategy.name=flash").startswith("strategy.name:")
    point = planned("strategy=flash", "strategy._target_=strategies.contiguous.ContiguousStrategy")[0].point
    assert point.strategy.name == ContiguousStrategy.name
    assert point.strategy.strategy_class == "strategies.contiguous.ContiguousStrategy"
    assert build_row(point, not_run("skipped", "x"))["strategy"] == ContiguousStrategy.name


# --- 5. Faults end in one line, and the rest goes on ----------------------------------------------


def assert_whole(results: Path, written: int) -> None:
    rows = sorted(results.glob("*.parquet"))
    assert len(rows) == written and all(pq.read_table(p).num_rows == 1 for p in rows)
    assert not list(results.glob(".*.tmp-*")) and not list((results / "_calibration").glob(".*tmp*"))


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


def test_ctrl_c_prints_one_line_and_exits_130(tmp_path):
    """SIGINT to the process group, as Ctrl-C sends it, a second into the sweep: the runner, its fork
    server (importing torch then) and the point's process all get it."""
    results = seeded(tmp_path / "results")
    args = ["-m", *TINY[:-1], "decode_tokens=300", "batch=1,2,3,4", f"results_dir={results}"]  # isolated points
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
    from harness.run import calibration

    running, calls, results = [], [], {}

    def slow_measure(fn, arg):
        assert fn is calibration.measure_within and arg[:2] == ("cpu", "float32")
        running.append(1)
        assert len(running) == 1, "two calibrations at once"
        calls.append(arg)
        time.sleep(0.5)
        running.pop()
        return fake_calibration(timestamp="2999-01-01T00:00:00+00:00")

    def worker(name):
        results[name] = calibration.ensure(tmp_path, "cpu", "float32", False, slow_measure, budget_s=30)

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
    assert "another process is calibrating cpu/float32" in caplog.text


def test_a_calibration_that_cannot_be_saved_leaves_no_temporary(tmp_path, monkeypatch):
    from harness.run import calibration

    def full_save(results_dir, record):
        path = calibration.record_path(results_dir, record.device, record.dtype)
        path.with_name(f".{path.name}.tmp-{os.getpid()}").write_text("{half")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(calibration, "save", full_save)
    with pytest.raises(OSError):
        calibration.ensure(tmp_path, "cpu", "float32", False, lambda fn, arg: fake_calibration())
    assert [p.name for p in (tmp_path / "_calibration").iterdir()] == ["cpu__float32.lock"]


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
    from harness.run.calibration import measure_within

    began = time.monotonic()
    record = measure_within(("cpu", "float32", 0.2))
    assert time.monotonic() - began < 8
    assert record.read_bandwidth_Bps > 0 and record.matmul_flops > 0
    assert "of a 0.2 s budget" in record.method and "timed runs: read kernels" in record.method
    assert "shrunk from 2048" in record.method


def test_a_point_that_does_not_fit_leaves_kernel_null(tmp_path):
    results = seeded(tmp_path / "results")
    result = cli("-m", *FAST, f"batch={2**30}", f"results_dir={results}")
    assert result.returncode == 0, result.stderr
    (row,) = pq.read_table(results).to_pylist()
    assert row["status"] == "skipped" and "does not fit" in row["reason"] and row["kernel"] is None


# --- 6. Every analytic figure in closed form ---------------------------------------------------------


def test_analytic_figures_answer_quickly_for_any_accepted_size():
    analytic("model=tiny")  # Hydra and the strategy classes imported once
    for args in (["decode_tokens=1000000000000"],
                 [f"batch={INT64_MAX}", f"ctx={INT64_MAX}", f"decode_tokens={INT64_MAX}", "model=llama3_405b"],
                 ["hardware.flops.bfloat16=1", "hardware.bandwidth_Bps=1e18", f"decode_tokens={INT64_MAX}"],
                 ["strategy=quantized", "strategy.residual=64", f"decode_tokens={10**15}"]):
        began = time.monotonic()
        code, out, err = analytic(*args, "format=json")
        assert code == 0, err
        assert time.monotonic() - began < 1.0, args
        figures = json.loads(out, parse_constant=lambda name: pytest.fail(f"{name} in the JSON output"))
        assert figures["generate_s_cached"] > 0


def test_the_analytic_summary_itself_is_closed_form():
    from harness.analysis import analytic as model
    from harness.config import ModelConfig

    shape = ModelConfig(name="x", vocab_size=128256, d_model=8192, n_layers=80, n_heads=64, n_kv_heads=8,
                        ffn_dim=28672, head_dim=128)
    roof = model.Roof(flops_per_s=1e15, bytes_per_s=3e12)
    began = time.monotonic()
    for tokens in (1, 10**6, 10**12, INT64_MAX):
        model.summary(shape, "bfloat16", 1, 4096, tokens, roof)
    assert time.monotonic() - began < 0.1

"""Shared helpers of the hardening tests (test_hardening_input.py, test_hardening_faults.py): the CLI
run in a subprocess, planted rows and calibration records, a tmpfs for a full disk."""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from harness.config.validate import ConfigError
from harness.run.plan import plan
from harness.run.row import build_row
from harness.store.calibration import Calibration, save
from harness.store.files import write_row
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
                       read_bandwidth_packed_gemv_Bps=None, matmul_flops=1e11, timestamp=timestamp, method="planted",
                       read_bandwidth_c_gemv_Bps=1e10)  # covers matmul=c, which auto picks on a CPU in fp32


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
    return plan([*TINY, *overrides], cuda_available=NO_CUDA).planned


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



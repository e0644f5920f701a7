"""One serving point, measured in its own process (harness.run runs it through harness.run.isolation):
the strategy's pool built within the budget, the workload served on the machine's clock, every served
token checked against the recompute reference, and the row's measured columns with every request's
record beside them.

A strategy that cannot serve here (it declares no pool, its kernel cannot run, it cannot take prompt
chunks where the point asks for them) is a skipped outcome with its reason; an error while serving
fails the point with it. The model, the pool and one scratch request are set up and run before the
clock starts, so the first request pays no lazy initialisation (a thread pool, a kernel library).

A strategy declaring `serves_requests` (vLLM: strategies/engines/vllm_serving.py) schedules the requests
itself: the workload, its prompts and the budget are handed to its engine whole
(harness.serve.engine_serving), and what the engine's own request metrics say becomes the same records,
so its row and per-request file carry the same columns and its tokens the same check. Where the engine
refuses (its environment is not installed, the budget holds no request in its accounting), the row is
skipped in its words; it never falls back to another engine.
"""
from __future__ import annotations

import os
import traceback
from dataclasses import dataclass, replace
from typing import Optional

import torch

from harness.config import Point
from harness.measure.contention import CpuTimes, others_fraction, others_fraction_since
from harness.measure.decoding import not_run
from harness.measure.device import device_name
from harness.measure.memory import PeakTracker
from harness.measure.prompts import checked_tokens
from harness.model import build_model
from harness.model.cpu_linear import KERNELS as MATMUL_KERNELS
from harness.serve import exactness, metrics
from harness.serve.engine_serving import serve_on_engine
from harness.serve.executor import DecoderExecutor, request_prompts
from harness.serve.memory import KVMemory
from harness.serve.records import ServingOutcome, WallClock
from harness.serve.scheduler import serve
from harness.serve.step_observations import IterationRecorder
from harness.serve.workload import Workload, build_workload
from strategies.base import StrategyUnavailable

SCRATCH = -1  # the warm-up request's sequence id: no request of a workload has it
PEAK_COLUMNS = ("peak_memory_bytes", "peak_memory_reserved_bytes", "process_baseline_bytes")  # PeakTracker.read
TIMING_METHOD = "perf_counter around each iteration (CUDA: synchronized), arrivals on the wall clock"


def serve_point(point: Point) -> dict:
    """The measured dict of a serving point (harness.run.row makes it a row); its `requests` entry (not a
    column) holds one dict per request for the per-request file, its `iterations_log` the iteration log
    (harness.serve.step_observations) for the iterations file."""
    with torch.inference_mode():
        try:
            return _serve(point)
        except Exception as error:  # a failure of this point, with its reason; the sweep goes on
            return {**not_run("failed", f"{type(error).__name__}: {error}"),
                    "traceback": "".join(traceback.format_exception(type(error), error, error.__traceback__))}


def unservable(point: Point, strategy) -> str | None:
    """Why the point's strategy cannot serve it (a skipped row), or None."""
    reason = strategy.serving_unavailable()
    if reason is not None:
        return reason
    if point.serving.serving.prefill_chunk is not None and not type(strategy).chunked_prefill:
        return (f"serving.prefill_chunk={point.serving.serving.prefill_chunk}: {strategy.name} prefills a prompt "
                "whole (chunked_prefill is False); serve it with serving.prefill_chunk=null")
    return None


@dataclass(frozen=True)
class Served:
    """A workload served, by the harness's scheduler on the strategy's pool or by an engine that schedules
    itself, as the row needs it."""

    outcome: ServingOutcome
    outputs: list[list[int]]  # each request's output token ids, in index order
    kernel: str
    matmul_kernel: Optional[str]  # None: the engine's own, unknown here
    timing_method: str
    contention: float
    kv_cache_bytes: int  # bytes of KV storage the server allocated for the budget
    peak: dict  # peak_memory_* columns: this process's, or None where the engine ran in another
    iterations_log: Optional[dict] = None  # columns of the iterations (IterationRecorder.table), a simulation's fit; None: an engine's


def _serve(point: Point) -> dict:
    device, dtype = torch.device(point.device), getattr(torch, point.dtype)
    spec = point.serving
    strategy = point.strategy.instantiate()
    reason = unservable(point, strategy)
    try:
        strategy.kernel(device, dtype, point.model)
    except StrategyUnavailable as unavailable:
        reason = reason or str(unavailable)
    if reason is not None:
        return {**not_run("skipped", reason), **strategy.row_columns()}
    workload = build_workload(spec.workload, point.seed)
    model = build_model(point.model, device, dtype, point.seed, point.matmul, batch_hint=min(spec.serving.max_batch, 16))
    layout = strategy.sequence_memory(model.cfg, dtype)
    ids = checked_tokens(point, sum(r.prompt_len for r in workload.requests)) if point.prompt else None
    prompts = request_prompts(workload, ids, model.cfg.vocab_size, point.seed, device)
    serve_with = _serve_on_engine if type(strategy).serves_requests else _serve_on_pool
    try:
        served = serve_with(point, strategy, model, workload, prompts, layout)
    except StrategyUnavailable as refused:  # an engine's refusal (a budget or a length), in its words
        return {**not_run("skipped", str(refused)), **strategy.row_columns()}
    measured = {"status": "ok", "reason": "", "kernel": served.kernel, "matmul_kernel": served.matmul_kernel,
                "compile_mode": "eager", "device_name": device_name(device), "timing_method": served.timing_method,
                "contention": served.contention, "kv_cache_bytes": served.kv_cache_bytes, **served.peak,
                "serving_placement": layout.placement, "serving_reserves": layout.reserved,
                "serving_kv_bytes_per_token": layout.bytes_per_token, "serving_kept_tokens": layout.kept_tokens,
                **metrics.summary(served.outcome, spec.serving.slo.ttft_s, spec.serving.slo.tpot_s),
                **strategy.row_columns()}
    checks = exactness.check_tokens(model, prompts, served.outputs) if spec.serving.check_tokens else None
    if checks is not None:
        measured.update(exactness.summary(checks, served.outputs))
    measured["requests"] = request_rows(point, workload, served.outcome, served.outputs, checks)
    if served.iterations_log is not None:
        measured["iterations_log"] = served.iterations_log
    return measured


def _serve_on_pool(point: Point, strategy, model, workload: Workload, prompts, layout) -> Served:
    """The harness's scheduler on the strategy's serving pool, in this process."""
    device, spec = model.device, point.serving.serving
    peak = PeakTracker(device)
    peak.start()
    budget = int(spec.kv_budget_bytes)
    memory = KVMemory(layout, budget)
    max_len = max(r.prompt_len + max(r.output_len, r.max_tokens) for r in workload.requests) + 1
    pool = strategy.new_pool(model, layout, budget, max_len)
    executor = DecoderExecutor(pool, workload, prompts, device)
    _warm_up(pool, memory, prompts[0], device)
    clock = WallClock()
    recorder = IterationRecorder(executor, point.strategy.layout, clock)  # the log a simulation's step time is fitted from
    began = CpuTimes.now()
    outcome = serve(workload, memory, recorder, clock, spec.prefill_chunk, spec.max_batch)
    contention = others_fraction_since(began)
    return Served(outcome, executor.outputs, pool.kernel, MATMUL_KERNELS[point.matmul], TIMING_METHOD, contention,
                  budget, peak.read(), recorder.table())


def _serve_on_engine(point: Point, strategy, model, workload: Workload, prompts, layout) -> Served:
    """The workload handed whole to an engine that schedules itself (harness.serve.engine_serving), in its
    own process: its request timings, its KV cache as it cut the budget. Contention counts the engine's
    processes (this one's children, reaped when it returns) as the point's own; the engine's memory is
    not this process's, so the peak columns stay null."""
    spec = point.serving.serving
    began, children = CpuTimes.now(), _children_cpu_s()
    run = serve_on_engine(strategy, model, workload, [p.tolist() for p in prompts], int(spec.kv_budget_bytes),
                          spec.max_batch, spec.prefill_chunk)
    ended = CpuTimes.now()
    ended = replace(ended, mine=ended.mine + _children_cpu_s() - children)
    engine = run.engine
    kernel = strategy.kernel(model.device, model.dtype, point.model)
    timing = (f"{strategy.engine} {engine.version}'s own request metrics (arrival, first scheduled, each token at the end of its engine "
              f"step), on its clock from the run's start; its KV cache {engine.num_blocks:,} blocks of "
              f"{engine.block_size} tokens, {engine.usable_kv_tokens:,} tokens usable (one block is its null block), "
              f"{engine.threads} threads, started in {engine.startup_s:.0f} s")
    return Served(run.outcome, [list(t) for t in run.output_token_ids], kernel, None, timing,
                  others_fraction(began, ended), engine.kv_cache_bytes, dict.fromkeys(PEAK_COLUMNS))


def _children_cpu_s() -> float:
    """CPU seconds of this process's reaped children (all their threads)."""
    times = os.times()
    return times.children_user + times.children_system


def _warm_up(pool, memory: KVMemory, prompt: torch.Tensor, device: torch.device) -> None:
    """A scratch request through the pool, untimed: a short prompt and two decode steps, then its memory
    back. Where not even that fits the budget, nothing (the first request then pays the start-up)."""
    tokens = min(len(prompt), 8)
    if not memory.admit(SCRATCH, tokens, tokens + 2):
        return
    pool.place(SCRATCH, memory.placement(SCRATCH), tokens + 2)
    logits = pool.prefill(SCRATCH, prompt[:tokens][None], 0)
    for position in (tokens, tokens + 1):
        if memory.grow(SCRATCH, position + 1):
            pool.place(SCRATCH, memory.placement(SCRATCH), tokens + 2)
            logits = pool.decode([SCRATCH], logits.argmax(-1), [position])
    pool.release(SCRATCH)
    memory.free(SCRATCH)


def request_rows(point: Point, workload: Workload, outcome, outputs: list[list[int]], checks) -> list[dict]:
    """One dict per request, the per-request file's columns (harness.store.columns.REQUEST_COLUMNS)."""
    spec = point.serving
    rows = []
    for i, record in enumerate(outcome.requests):
        check = checks[i] if checks is not None else None
        rows.append({
            "point_key": point.key, "strategy": point.strategy.variant, "workload": spec.workload.name,
            "workload_rate": spec.workload.rate, "serving_kv_budget_bytes": float(spec.serving.kv_budget_bytes),
            "request": record.request.index, "arrival_s": record.arrival_s, "prompt_len": record.request.prompt_len,
            "output_len": record.request.output_len, "max_tokens": record.request.max_tokens,
            "admitted_s": record.admitted_s, "queue_wait_s": record.queue_wait_s, "ttft_s": record.ttft_s,
            "tpot_s": record.tpot_s, "e2e_s": record.e2e_s, "itl_s": record.itl_s,
            "token_times_s": list(record.token_times_s), "preemptions": record.preemptions,
            "output_tokens": outputs[i],
            "first_divergence": check.first_divergence if check else None,
            "divergence_margin": check.divergence_margin if check else None,
            "reference_agreement": check.reference_agreement if check else None,
        })
    return rows

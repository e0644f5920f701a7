"""One serving point, measured in its own process (harness.run runs it through harness.run.isolation):
the strategy's pool built within the budget, the workload served on the machine's clock, every served
token checked against the recompute reference, and the row's measured columns with every request's
record beside them.

A strategy that cannot serve here (it declares no pool, its kernel cannot run, it cannot take prompt
chunks where the point asks for them) is a skipped outcome with its reason; an error while serving
fails the point with it. The model, the pool and one scratch request are set up and run before the
clock starts, so the first request pays no lazy initialisation (a thread pool, a kernel library).
"""
from __future__ import annotations

import traceback

import torch

from harness.config import Point
from harness.measure.contention import CpuTimes, others_fraction_since
from harness.measure.decoding import not_run
from harness.measure.device import device_name
from harness.measure.memory import PeakTracker
from harness.measure.prompts import checked_tokens
from harness.model import build_model
from harness.model.cpu_linear import KERNELS as MATMUL_KERNELS
from harness.serve import exactness, metrics
from harness.serve.executor import DecoderExecutor, request_prompts
from harness.serve.memory import KVMemory
from harness.serve.records import WallClock
from harness.serve.scheduler import serve
from harness.serve.step_observations import IterationRecorder
from harness.serve.workload import Workload, build_workload
from strategies.base import StrategyUnavailable

SCRATCH = -1  # the warm-up request's sequence id: no request of a workload has it
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
        return not_run("skipped", reason)
    workload = build_workload(spec.workload, point.seed)
    model = build_model(point.model, device, dtype, point.seed, point.matmul, batch_hint=min(spec.serving.max_batch, 16))
    peak = PeakTracker(device)
    peak.start()
    layout = strategy.sequence_memory(model.cfg, dtype)
    budget = int(spec.serving.kv_budget_bytes)
    memory = KVMemory(layout, budget)
    max_len = max(r.prompt_len + max(r.output_len, r.max_tokens) for r in workload.requests) + 1
    pool = strategy.new_pool(model, layout, budget, max_len)
    ids = checked_tokens(point, sum(r.prompt_len for r in workload.requests)) if point.prompt else None
    prompts = request_prompts(workload, ids, model.cfg.vocab_size, point.seed, device)
    executor = DecoderExecutor(pool, workload, prompts, device)
    _warm_up(pool, memory, prompts[0], device)
    clock = WallClock()
    recorder = IterationRecorder(executor, point.strategy.layout, clock)  # the log a simulation's step time is fitted from
    began = CpuTimes.now()
    outcome = serve(workload, memory, recorder, clock, spec.serving.prefill_chunk, spec.serving.max_batch)
    contention = others_fraction_since(began)
    measured = {"status": "ok", "reason": "", "kernel": pool.kernel, "matmul_kernel": MATMUL_KERNELS[point.matmul],
                "compile_mode": "eager", "device_name": device_name(device), "timing_method": TIMING_METHOD,
                "contention": contention, "kv_cache_bytes": budget, **peak.read(),
                "serving_placement": layout.placement, "serving_reserves": layout.reserved,
                "serving_kv_bytes_per_token": layout.bytes_per_token, "serving_kept_tokens": layout.kept_tokens,
                **metrics.summary(outcome, spec.serving.slo.ttft_s, spec.serving.slo.tpot_s)}
    checks = exactness.check_tokens(model, prompts, executor.outputs) if spec.serving.check_tokens else None
    if checks is not None:
        measured.update(exactness.summary(checks, executor.outputs))
    measured["requests"] = request_rows(point, workload, outcome, executor.outputs, checks)
    measured["iterations_log"] = recorder.table()
    return measured


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

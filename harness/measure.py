"""Measure one point: prefill, warm-up, then `decode_tokens` greedy steps, each timed on its own.

Runs inside the point's own process (harness.isolation). Returns the measured half of a row as a plain
dict; `harness.record` adds the configuration, the analytic model and the run metadata.
"""
from __future__ import annotations

import hashlib
import os

import torch
from hydra.utils import instantiate

from harness.cpu_linear import KERNELS as MATMUL_KERNELS
from harness.graphs import EAGER_WARMUP_STEPS, GraphedSteps
from harness.memory import GIB, PeakTracker, available_bytes, required_bytes
from harness.model import build_model
from harness.points import Point
from harness.timing import StepStats, StepTimer, warm_up
from strategies.base import StrategyUnavailable


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    with open("/proc/cpuinfo") as f:
        model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "cpu")
    return f"{model} ({os.cpu_count()} threads)"


def tokens_digest(tokens: torch.Tensor) -> str:
    """Short hash of generated token ids [B, n]: equal digests mean identical greedy outputs."""
    return hashlib.sha256(tokens.to("cpu", torch.int64).numpy().tobytes()).hexdigest()[:16]


def not_run(status: str, reason: str, **extra) -> dict:
    return {"status": status, "reason": reason, **extra}


def start_decode(point: Point, session, generator: torch.Generator, timer: StepTimer | None = None):
    """Bring a fresh session to the first decode position: run the prompt (timed when a timer is
    given) or, with prefill=random, fill the cache with random K/V. Returns (first token [B],
    prefill seconds or None). The random draws come in one fixed order, so every caller that seeds
    the same generator gets the same prompt, cache and tokens."""
    vocab = point.model.vocab_size
    if point.prefill == "random":
        session.fill_random(point.ctx, generator)
        return torch.randint(vocab, (point.batch,), generator=generator, device=generator.device), None
    prompt = torch.randint(vocab, (point.batch, point.ctx), generator=generator, device=generator.device)  # [B, P]
    if timer is None:
        return session.prefill(prompt).argmax(-1), None
    logits, seconds = timer.time(lambda: session.prefill(prompt))
    return logits.argmax(-1), seconds


def measure_point(point: Point) -> dict:
    device, dtype = torch.device(point.device), getattr(torch, point.dtype)
    strategy = instantiate(point.strategy)
    common = {"device_name": device_name(device), "threads": torch.get_num_threads()}
    try:
        kernel = strategy.kernel(device, dtype, point.model)
    except StrategyUnavailable as unavailable:
        return not_run("skipped", str(unavailable), kernel=None, **common)

    need = required_bytes(point.model, point.dtype, strategy.caches_kv, point.batch, point.ctx, point.decode_tokens,
                           point.prefill)
    have = available_bytes(point.device)
    if need > have:
        reason = f"does not fit in memory: needs ~{need / GIB:.1f} GiB, {have / GIB:.1f} GiB available"
        return not_run("skipped", reason, kernel=kernel, **common)

    peak = PeakTracker(device)
    peak.start()
    model = build_model(point.model, device, dtype, point.seed, point.matmul, batch_hint=point.batch)
    peak.reset_peak()
    session = strategy.new_session(model, point.batch, point.ctx + point.decode_tokens)
    timer = StepTimer(device, cold_cache=point.timing.cold_cache)
    generator = torch.Generator(device=device).manual_seed(point.seed)

    first_token, prefill_s = start_decode(point, session, generator, timer)

    def first_step_again() -> float:
        _, seconds = timer.time(lambda: session.step(first_token))
        session.rewind(point.ctx)  # warm-up never advances the sequence: outputs stay comparable
        return seconds

    t = point.timing
    if t.cuda_graphs:
        graphed = GraphedSteps(session, first_token, point.decode_tokens)  # captures every step up front
        warmup_steps = EAGER_WARMUP_STEPS + warm_up(graphed.first_step_probe(timer.time), t.warmup_min,
                                                    t.warmup_max, t.settle_tolerance)

        def timed_step(token):  # the step at the next position, replayed from its graph
            return graphed.replay_next(token, timer.time)
    else:
        warmup_steps = warm_up(first_step_again, t.warmup_min, t.warmup_max, t.settle_tolerance)

        def timed_step(token):
            return timer.time(lambda: session.step(token).argmax(-1))

    generated, step_seconds = [first_token], []
    for _ in range(point.decode_tokens):
        token, seconds = timed_step(generated[-1])
        generated.append(token)
        step_seconds.append(seconds)
    tokens = torch.stack(generated, dim=1)  # [B, decode_tokens + 1]

    stats = StepStats.of(step_seconds)
    return {
        "status": "ok",
        "reason": "",
        "kernel": kernel,
        "matmul_kernel": MATMUL_KERNELS[point.matmul],
        **common,
        "prefill_s": prefill_s,
        "decode_step_s": stats.p50,
        "decode_step_p10_s": stats.p10,
        "decode_step_p90_s": stats.p90,
        "decode_steps_timed": stats.count,
        "warmup_steps": warmup_steps,
        "timing_method": timer.method + (", CUDA graph replay" if t.cuda_graphs else ""),
        "tokens_per_s": point.batch / stats.p50,
        "kv_cache_bytes": session.kv_cache_bytes,
        **peak.read(),
        "tokens_digest": tokens_digest(tokens),
        "tokens": tokens.cpu().tolist(),  # for tests and callers; not stored in the row
    }

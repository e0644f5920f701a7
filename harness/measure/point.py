"""Measure one point: prefill, warm-up, then `decode_tokens` greedy steps, each timed on its own.

Runs inside the point's own process (harness.run.isolation). Returns the measured half of a row as a plain
dict; `harness.run.row` adds the configuration, the analytic model and the run metadata.
"""
from __future__ import annotations

import hashlib

import torch

from harness.config import Point
from harness.measure.accuracy import not_measured, reference_strategy, teacher_forced
from harness.measure.prompts import point_prompt
from harness.measure.compiled import CompiledSteps
from harness.measure.contention import CpuTimes, gpu_state, others_fraction_since
from harness.measure.device import device_name
from harness.measure.graphs import EAGER_WARMUP_STEPS, GraphedSteps
from harness.measure.memory import PeakTracker, anon_hugepages_bytes, shortfall, use_hugepages
from harness.measure.timing import StepStats, StepTimer, warm_up
from harness.model import build_model
from harness.model.cpu_linear import KERNELS as MATMUL_KERNELS
from strategies.base import StrategyUnavailable


def tokens_digest(tokens: torch.Tensor) -> str:
    """Short hash of generated token ids [B, n]: equal digests mean identical greedy outputs."""
    return hashlib.sha256(tokens.to("cpu", torch.int64).numpy().tobytes()).hexdigest()[:16]


def not_run(status: str, reason: str, **extra) -> dict:
    return {"status": status, "reason": reason, **extra}


def start_decode(point: Point, new_session, generator: torch.Generator, timer: StepTimer | None = None):
    """A session brought to the first decode position: the prompt run (timed, and repeated when a
    timer is given) or, with prefill=random, the cache filled with random K/V. `new_session()` makes a
    fresh session: each timed repeat of the prompt runs on a fresh one, so a cache never sees its
    prompt twice. Returns (session, first token [B], prefill StepStats or None). The random draws come
    in one fixed order, so every caller that seeds the same generator gets the same prompt, cache and
    tokens."""
    vocab = point.model.vocab_size
    session = new_session()
    if point.prefill == "random":
        session.fill_random(point.ctx, generator)
        return session, torch.randint(vocab, (point.batch,), generator=generator, device=generator.device), None
    if point.prompt is not None:  # the prompt file's windows: their first ctx tokens
        prompt = point_prompt(point, generator.device)[:, : point.ctx]  # [B, P]
    else:
        prompt = torch.randint(vocab, (point.batch, point.ctx), generator=generator, device=generator.device)  # [B, P]
    if timer is None:
        return session, session.prefill(prompt).argmax(-1), None
    logits, first = timer.time(lambda: session.prefill(prompt))
    seconds, budget = [first], point.timing.prefill_budget_s
    # Repeat while the budget allows: a long prompt is timed once, a short one up to prefill_repeats times.
    while len(seconds) < point.timing.prefill_repeats and sum(seconds) + seconds[-1] <= budget:
        del session
        session = new_session()
        logits, again = timer.time(lambda: session.prefill(prompt))
        seconds.append(again)
    return session, logits.argmax(-1), StepStats.of(seconds)


def accuracy(point: Point, strategy, model) -> dict:
    """The accuracy columns: measured for a strategy that is not exact and computed its prompt; null
    with the reason otherwise."""
    if point.strategy.exact:
        return not_measured("exact strategy: its tokens equal the reference's (tokens_digest)")
    if point.prefill != "compute":
        return not_measured("prefill=random: no prompt to run the exact reference on")
    if point.reference is None:
        return not_measured("no exact reference strategy was chosen for this point")
    text = None
    if point.prompt is not None:  # the timed run's prompt, then the text that follows it, fed and scored
        window = point_prompt(point, model.device)  # [B, ctx + decode_tokens + 1]
        prompt, text = window[:, : point.ctx], window[:, point.ctx :]
    else:
        generator = torch.Generator(device=model.device).manual_seed(point.seed)  # the timed run's prompt
        prompt = torch.randint(point.model.vocab_size, (point.batch, point.ctx), generator=generator, device=model.device)
    return teacher_forced(strategy, reference_strategy(point.reference), model, prompt, point.decode_tokens, text)


def measure_point(point: Point) -> dict:
    if point.hugepages:  # first: torch's allocator reads it at this process's first allocation
        use_hugepages()
    # Inference mode: no step pays for autograd's version counters and view tracking (measured 15% of
    # the tiny model's step, which is all overhead).
    with torch.inference_mode():
        return _measure_point(point)


def _measure_point(point: Point) -> dict:
    device, dtype = torch.device(point.device), getattr(torch, point.dtype)
    torch.set_num_threads(point.threads)
    strategy = point.strategy.instantiate()
    common = {"device_name": device_name(device)}
    try:
        kernel = strategy.kernel(device, dtype, point.model)
    except StrategyUnavailable as unavailable:
        return not_run("skipped", str(unavailable), **common)
    if point.compile != "none" and not type(strategy).compilable:
        return not_run("skipped", f"compile={point.compile}: {strategy.name} does not declare itself compilable "
                                  "(its decode step does not trace into one torch.compile graph)", **common)
    if point.device == "cuda":  # free GPU memory is known only here; CPU points were checked by the plan
        reason = shortfall(point)
        if reason is not None:
            return not_run("skipped", reason, **common)

    peak = PeakTracker(device)
    peak.start()
    model = build_model(point.model, device, dtype, point.seed, point.matmul, batch_hint=point.batch)
    peak.reset_peak()
    timer = StepTimer(device, cold_cache=point.timing.cold_cache)
    generator = torch.Generator(device=device).manual_seed(point.seed)
    session, first_token, prefill = start_decode(
        point, lambda: strategy.new_session(model, point.batch, point.max_len), generator, timer)
    compiled = CompiledSteps(session, first_token, device, timer.time) if point.compile != "none" else None
    step = compiled.step if compiled else session.step  # the prompt above ran eager either way

    def first_step_again() -> float:
        _, seconds = timer.time(lambda: step(first_token))
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
            return timer.time(lambda: step(token).argmax(-1))

    generated, step_seconds = [first_token], []
    before = CpuTimes.now()
    for _ in range(point.decode_tokens):
        token, seconds = timed_step(generated[-1])
        generated.append(token)
        step_seconds.append(seconds)
    contention = others_fraction_since(before)  # the steps, padded to a window /proc/stat resolves
    recompiles = compiled.recompiles_since() if compiled else None  # before any other code can compile
    gpu = gpu_state(device.index or 0) if device.type == "cuda" else {}
    tokens = torch.stack(generated, dim=1)  # [B, decode_tokens + 1]
    memory = peak.read()  # before the accuracy pass below: the point's peak is the timed session's
    hugepage_bytes = anon_hugepages_bytes()  # what the pages were, whatever was asked
    cache_bytes = session.kv_cache_bytes
    del session
    stats = StepStats.of(step_seconds)
    return {
        "status": "ok",
        "reason": "",
        "kernel": kernel,
        "matmul_kernel": MATMUL_KERNELS[point.matmul],
        "compile_mode": compiled.call if compiled else "eager",
        "compile_s": compiled.compile_s if compiled else None,
        "compile_recompiles": recompiles,
        **common,
        "prefill_s": prefill.p50 if prefill else None,
        "prefill_p10_s": prefill.p10 if prefill else None,
        "prefill_p90_s": prefill.p90 if prefill else None,
        "prefill_repeats": prefill.count if prefill else None,
        "decode_step_s": stats.p50,
        "decode_step_p10_s": stats.p10,
        "decode_step_p90_s": stats.p90,
        "decode_steps_timed": stats.count,
        "warmup_steps": warmup_steps,
        "timing_method": timer.method + (", CUDA graph replay" if t.cuda_graphs else ""),
        "tokens_per_s": point.batch / stats.p50,
        "contention": contention,
        **gpu,
        "kv_cache_bytes": cache_bytes,
        **memory,
        "anon_hugepages_bytes": hugepage_bytes,
        **accuracy(point, strategy, model),
        "tokens_digest": tokens_digest(tokens),
        "tokens": tokens.cpu().tolist(),  # for tests and callers; not stored in the row
    }

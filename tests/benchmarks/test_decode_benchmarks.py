"""Benchmarks gated by harness.bench.gate: the two control kernels, decode steps and a prefill.

Every benchmark records in extra_info what the gate needs (role, bytes and FLOPs from harness.analysis.analytic)
and its analytic prediction: the roofline time at the roofs the control kernels reach in this run
(conftest.same_run_roofs). Each is timed by conftest.time_benchmark and asserts what it timed did its work.
Run: `python -m pytest -m benchmark --benchmark-json=run.json && python -m harness.bench run.json`.
"""
from __future__ import annotations

import pytest
import torch

from harness.analysis import analytic
from harness.run.catalog import strategy_catalog
from strategies import StrategyUnavailable
from strategies.caches.contiguous import ContiguousStrategy
from tests.benchmarks.conftest import DTYPE, MATMUL, POINTS, PREFILL, SEED, control_for, time_benchmark

pytestmark = pytest.mark.benchmark
DTYPE_NAME = str(DTYPE).removeprefix("torch.")


def record_prediction(benchmark, roof: analytic.Roof, phases: tuple[analytic.Phase, ...]) -> None:
    """bytes, FLOPs, each phase's (the matmuls, then attention), and the roofline time at this run's roofs."""
    benchmark.extra_info.update(bytes=sum(phase.bytes for phase in phases), flops=sum(phase.flops for phase in phases),
                                phases=[[phase.flops, phase.bytes] for phase in phases],
                                roof_bandwidth_Bps=roof.bytes_per_s, roof_flops=roof.flops_per_s,
                                predicted_s=analytic.phased_time(phases, roof),
                                predicted_bound=analytic.phased_bound(phases, roof))


def test_control_read_bandwidth(benchmark, same_run_roofs, controls):
    """The memory control on its own (conftest.MemoryControl): the denominator of ratios measured
    without interleaving. It must be memory bound at this run's roofs: the gate divides memory-bound
    steps by it."""
    control = controls["memory"]
    benchmark.extra_info.update(role="control", kernel=control.name, bytes=control.nbytes, flops=control.flops)
    time_benchmark(benchmark, control, budget_s=1.0)
    assert analytic.bound(control.flops, control.nbytes, same_run_roofs) == "memory", same_run_roofs


def test_roof_matmul(benchmark, same_run_roofs, controls):
    """The compute control on its own (conftest.ComputeControl): the FLOP roof of this run. It must be
    compute bound at this run's roofs: the gate divides compute-bound benchmarks by it."""
    control = controls["compute"]
    benchmark.extra_info.update(role="roof_flops", kernel=control.name, bytes=control.nbytes, flops=control.flops)
    time_benchmark(benchmark, control, budget_s=0.6)
    assert analytic.bound(control.flops, control.nbytes, same_run_roofs) == "compute", same_run_roofs


# Every strategy of the `strategy` config group (shipped, or on $HARNESS_SEARCHPATH) at its default
# options; a point filled with random K/V takes only the strategies that keep a cache. An engine peer
# decodes only a checkpoint's weights, which the suite's seeded shapes are not: +sweep=peers times those.
CATALOG = {name: cls for name, cls in strategy_catalog().items() if not cls.needs_checkpoint}
CASES = [(point, name) for point in POINTS.values() for name, cls in CATALOG.items()
         if cls.caches_kv or point.prefill == "compute"]


@pytest.mark.parametrize("point,strategy", CASES, ids=[f"{p.name}-{s}" for p, s in CASES])
def test_decode_step(benchmark, model_for, same_run_roofs, controls, point, strategy):
    """The first decode step after `point.ctx` cached tokens, re-run every round (rewound in setup)."""
    chosen = CATALOG[strategy]()
    try:
        chosen.kernel(torch.device("cpu"), DTYPE)
    except StrategyUnavailable as unavailable:
        pytest.skip(f"{strategy} cannot run on this CPU: {unavailable}")
    model = model_for(point.shape, point.batch)
    session = chosen.new_session(model, point.batch, point.ctx + 1)
    generator = torch.Generator().manual_seed(SEED)
    prompt = torch.randint(point.shape.vocab_size, (point.batch, point.ctx), generator=generator)  # [B, ctx]
    if point.prefill == "random" and chosen.caches_kv:
        session.fill_random(point.ctx, generator)
    else:
        session.prefill(prompt)
    token = prompt[:, -1]  # [B]
    layout = chosen.cache_layout(point.shape)
    step_bytes = analytic.decode_step_bytes(point.shape, DTYPE_NAME, point.batch, point.ctx, layout, point.ctx + 1)
    benchmark.extra_info.update(
        role="decode", point=point.name, strategy=strategy, caches_kv=chosen.caches_kv, model=point.shape.name, batch=point.batch, ctx=point.ctx,
        prefill=point.prefill, dtype=DTYPE_NAME, matmul=MATMUL, weight_bytes=analytic.weight_bytes(point.shape, DTYPE_NAME),
        cache_read_bytes=step_bytes["cache_read"],
    )
    flops = analytic.decode_step_flops(point.shape, point.batch, point.ctx, layout, point.ctx + 1)
    record_prediction(benchmark, same_run_roofs,
                      analytic.decode_step_phases(point.shape, DTYPE_NAME, point.batch, point.ctx, layout, point.ctx + 1))
    budget = 1.5 if chosen.caches_kv else 2.0  # a recompute step is slower: more time for its rounds
    with torch.inference_mode():
        _, logits = time_benchmark(benchmark, lambda: session.step(token), before=lambda: session.rewind(point.ctx),
                                   control=control_for(controls, flops, step_bytes["total"]), budget_s=budget)
    assert session.length == point.ctx + 1  # every timed call was one step from ctx
    assert logits.shape == (point.batch, point.shape.vocab_size) and torch.isfinite(logits).all()


def test_prefill(benchmark, model_for, same_run_roofs, controls):
    """One forward pass over a 256-token prompt through the contiguous cache (compute bound)."""
    shape, batch, prompt_len = PREFILL
    session = ContiguousStrategy().new_session(model_for(shape, batch), batch, prompt_len)
    prompt = torch.randint(shape.vocab_size, (batch, prompt_len), generator=torch.Generator().manual_seed(SEED))
    benchmark.extra_info.update(role="prefill", strategy="contiguous", model=shape.name, batch=batch, ctx=prompt_len,
                                dtype=DTYPE_NAME, matmul=MATMUL)
    prefill_bytes = analytic.prefill_bytes(shape, DTYPE_NAME, batch, prompt_len)["total"]
    flops = analytic.prefill_flops(shape, batch, prompt_len)
    record_prediction(benchmark, same_run_roofs, analytic.prefill_phases(shape, DTYPE_NAME, batch, prompt_len))
    with torch.inference_mode():
        _, logits = time_benchmark(benchmark, lambda: session.prefill(prompt),
                                   control=control_for(controls, flops, prefill_bytes), budget_s=1.5)
    assert session.length == prompt_len  # every timed call prefilled the whole prompt into an empty cache
    assert logits.shape == (batch, shape.vocab_size) and torch.isfinite(logits).all()

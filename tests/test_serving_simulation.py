"""Serving simulated: the analytic iteration against the analytic model's own step and prefill, the
node's KV budget against the capacity plan, the step-time fit, and a replay that reproduces a run."""
from __future__ import annotations

import itertools

import numpy as np
import pandas as pd
import pytest

from harness.analysis import analytic, capacity
from harness.analysis.analytic import Roof
from harness.analysis.iteration import IterationModel
from harness.config import CONTIGUOUS, CacheLayout, ModelConfig
from harness.serve.memory import KVMemory
from harness.serve.metrics import summary
from harness.serve.records import VirtualClock
from harness.serve.scheduler import serve
from harness.serve.simulation import FittedStepTime, RoofStepTime, SimulatedExecutor, simulate
from harness.serve.step_fit import (FEATURES, FitError, Observation, feature_vector, fit, iteration_features, nnls,
                                    pass_features)
from harness.serve.step_observations import IterationRecorder, serving_observations, step_observations
from harness.serve.workload import Request, Workload
from strategies.serving import ARENA, BLOCKS, SequenceMemory

SMALL = ModelConfig(name="small", vocab_size=1000, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128)
LLAMA3_70B = ModelConfig(name="llama3_70b", vocab_size=128256, d_model=8192, n_layers=80, n_heads=64,
                         n_kv_heads=8, ffn_dim=28672, head_dim=128)
H100 = Roof(flops_per_s=989e12, bytes_per_s=3.35e12)
LAYOUTS = {"contiguous": CONTIGUOUS, "paged16": CacheLayout(block_size=16),
           "int4_window": CacheLayout(value_bits=4, scale_bytes_per_token=8, residual_tokens=32),
           "budget64": CacheLayout(token_budget=64, eviction_score="accumulated_attention"),
           "dynamic": CacheLayout(copies_per_step=True)}


@pytest.mark.parametrize("layout", list(LAYOUTS.values()), ids=list(LAYOUTS))
@pytest.mark.parametrize("batch,context", [(1, 1), (3, 50), (8, 200)])
def test_a_homogeneous_iteration_is_the_analytic_decode_step(layout, batch, context):
    model = IterationModel(SMALL, "float32", layout)
    work = model.work([context] * batch, [])
    assert work.flops == analytic.decode_step_flops(SMALL, batch, context, layout)
    assert work.bytes == pytest.approx(analytic.decode_step_bytes(SMALL, "float32", batch, context, layout)["total"], rel=1e-12)
    # phase by phase too, so its time is the step's (a ridge between the phases' intensities)
    matmuls, attention = analytic.decode_step_phases(SMALL, "float32", batch, context, layout)
    assert work.matmuls.flops == matmuls.flops and work.attention.flops == attention.flops
    roof = analytic.Roof(flops_per_s=2e11, bytes_per_s=5e10)
    assert model.seconds([context] * batch, [], roof) == pytest.approx(
        analytic.decode_step_time(SMALL, "float32", batch, context, roof, layout), rel=1e-12)


@pytest.mark.parametrize("layout", list(LAYOUTS.values()), ids=list(LAYOUTS))
def test_a_whole_prompt_is_the_analytic_prefill_and_chunks_add_their_reads(layout):
    model = IterationModel(SMALL, "float32", layout)
    whole = model.work([], [(0, 96)])
    assert whole.flops == analytic.prefill_flops(SMALL, 1, 96)
    assert whole.bytes == analytic.prefill_bytes(SMALL, "float32", 1, 96, layout)["total"]
    halves = model.work([], [(0, 48)]).flops + model.work([], [(48, 48)]).flops
    # the same attention pairs; the second chunk's output head and its own pass are what chunking adds
    assert halves == whole.flops + 2 * SMALL.vocab_size * SMALL.d_model
    assert model.work([], [(48, 48)]).bytes > model.work([], [(0, 48)]).bytes  # it reads the first half's cache


def test_a_split_iteration_takes_one_devices_share_as_the_capacity_plan_does():
    model = IterationModel(LLAMA3_70B, "bfloat16", CONTIGUOUS, tp=8)
    planned = capacity.split_summary(LLAMA3_70B, "bfloat16", 32, 4096, 1, H100, CONTIGUOUS, tp=8)
    assert model.seconds([4096] * 32, [], H100) == pytest.approx(planned["decode_step_s"], rel=1e-12)
    alone = IterationModel(LLAMA3_70B, "bfloat16", CONTIGUOUS).seconds([4096] * 32, [], H100)
    assert alone / model.seconds([4096] * 32, [], H100) == pytest.approx(8, rel=0.01)


def test_the_nodes_kv_budget_holds_the_capacity_plans_tokens():
    budget = capacity.node_kv_budget_bytes(LLAMA3_70B, "bfloat16", 80e9, tp=8)
    per_token = analytic.kv_bytes_per_token(LLAMA3_70B, "bfloat16")
    assert int(budget // per_token) == capacity.capacity(LLAMA3_70B, "bfloat16", 80e9, 8).max_tokens == 1_327_130
    # past n_kv_heads the heads are replicated: 16 devices hold no more tokens per byte of room
    wide = ModelConfig(name="wide", vocab_size=1000, d_model=64, n_layers=2, n_heads=16, n_kv_heads=2, ffn_dim=128)
    plan = capacity.capacity(wide, "float32", 1e6, 16)
    assert capacity.node_kv_budget_bytes(wide, "float32", 1e6, 16) // analytic.kv_bytes_per_token(wide, "float32") \
        == plan.max_tokens


SPLIT = 16  # the linears' row split of the synthetic runs

TRUE = {"iteration": 2e-4, "passes": 1.2e-2, "rows": 1.6e-3, "wide_passes": 5e-2, "wide_rows": 1.4e-3,
        "decodes": 5e-5, "decode_keys": 2e-8, "prefill_pairs": 1e-9}


def _observed(coefficients: dict, count: int, seed: int = 0, prefill: bool = True) -> list[Observation]:
    """Iterations of random decodes and chunks, timed by `coefficients`."""
    rng = np.random.default_rng(seed)
    observations = []
    for _ in range(count):
        decodes = int(rng.integers(0, 40))
        chunks = [int(t) for t in rng.integers(1, 300, int(rng.integers(0, 3)))] if prefill else []
        if not decodes and not chunks:
            decodes = 1
        passes = ([decodes] if decodes else []) + chunks
        vector = feature_vector(iteration=1, **pass_features(passes, SPLIT), decodes=decodes,
                                decode_keys=decodes * int(rng.integers(1, 500)),
                                prefill_pairs=sum(t * (t + 1) // 2 for t in chunks))
        observations.append(Observation(tuple(vector.tolist()), float(np.dot(vector, [coefficients[n] for n in FEATURES]))))
    return observations


def test_the_fit_recovers_the_costs_that_made_the_times():
    fitted = fit(_observed(TRUE, 300), "synthetic")
    for name in FEATURES:
        assert fitted.coefficients[name] == pytest.approx(TRUE[name], rel=1e-6)
    assert fitted.residual_p90 < 1e-9 and fitted.total_ratio == pytest.approx(1)
    assert fitted.observations == 300 and fitted.source == "synthetic"
    assert fitted.unobserved == () and fitted.merged == ()


def test_a_fit_merges_what_its_observations_cannot_tell_apart_and_refuses_what_they_never_saw():
    decoding = fit(_observed(TRUE, 200, prefill=False), "rows")
    assert "prefill_pairs" in decoding.unobserved
    chunk = feature_vector(iteration=1, **pass_features([40], SPLIT), prefill_pairs=820)
    with pytest.raises(FitError, match="nothing observed computes prefill_pairs, which the replay needs; the rows "
                                       r"need prompts computed \(prefill=compute\)"):
        decoding.seconds(chunk)
    # one pass each, one decode per row: iteration, passes and decodes go together with rows
    steps = [Observation(tuple(feature_vector(**pass_features([b], SPLIT), decodes=b, decode_keys=b * c).tolist()),
                         1e-2 + 2e-3 * b + 1e-7 * b * c) for b in (1, 4, 8) for c in (100, 400)]
    merged = fit(steps, "steps")
    assert merged.merged == ("decodes",)
    assert merged.residual_p90 < 1e-9
    with pytest.raises(FitError, match="no observation"):
        fit([], "rows")


def test_a_fit_that_cannot_be_made_says_why():
    # every observation n narrow passes of 4 rows beside n wide ones of 40: no row cost can be told from the other
    alike = [Observation(tuple(feature_vector(passes=n, rows=4 * n, wide_passes=n, wide_rows=40 * n).tolist()), 0.1 * n)
             for n in (1, 2, 3, 4)]
    with pytest.raises(FitError, match="rows, wide_rows vary together in all 4 observations"):
        fit(alike, "rows")


def test_nnls_is_the_best_non_negative_solution():
    rng = np.random.default_rng(3)
    for _ in range(40):
        a, b = rng.normal(size=(12, 4)), rng.normal(size=12)
        x = nnls(a, b)
        candidates = []
        for k in range(5):
            for subset in itertools.combinations(range(4), k):
                z = np.zeros(4)
                if subset:
                    z[list(subset)] = np.linalg.lstsq(a[:, list(subset)], b, rcond=None)[0]
                if (z >= 0).all():
                    candidates.append(np.linalg.norm(a @ z - b))
        assert (x >= 0).all() and np.linalg.norm(a @ x - b) <= min(candidates) + 1e-9


class LinearExecutor:
    """Takes the time TRUE's costs give an iteration, on a virtual clock (a stand-in for the decoder)."""

    def __init__(self, layout):
        self.layout = layout

    def place(self, seq, placement):
        pass

    def release(self, seq):
        pass

    def run(self, iteration):
        return float(np.dot(iteration_features(iteration, self.layout, SPLIT), [TRUE[n] for n in FEATURES]))


def _workload(count=40, gap=0.02, seed=1):
    rng = np.random.default_rng(seed)
    return Workload(tuple(Request(i, i * gap, int(rng.integers(4, 60)), int(rng.integers(1, 40)), 40) for i in range(count)))


@pytest.mark.parametrize("layout,memory", [(CONTIGUOUS, SequenceMemory(100, ARENA, reserved=True)),
                                           (CacheLayout(block_size=4), SequenceMemory(100, BLOCKS, block_tokens=4))],
                         ids=["reserved", "paged"])
def test_a_replay_at_the_fitted_step_time_reproduces_the_run_it_was_fitted_from(layout, memory):
    work, budget = _workload(), 600 * 100  # tight: requests wait, paged sequences are preempted
    clock = VirtualClock()
    recorder = IterationRecorder(LinearExecutor(layout), layout, clock)
    measured = serve(work, KVMemory(memory, budget), recorder, clock, prefill_chunk=32, max_batch=16)
    observations = serving_observations(recorder.table(), SPLIT)
    assert len(observations) >= len(measured.iterations) - 3  # only cycles where every sequence left are unobserved
    fitted = fit(observations, "the run's iterations")
    replayed = simulate(work, KVMemory(memory, budget), FittedStepTime(fitted, layout, SPLIT), prefill_chunk=32, max_batch=16)
    for ours, theirs in zip(replayed.requests, measured.requests):
        assert ours.token_times_s == pytest.approx(theirs.token_times_s, rel=1e-6, abs=1e-9)
    assert replayed.preemptions == measured.preemptions
    assert summary(replayed)["output_throughput"] == pytest.approx(summary(measured)["output_throughput"], rel=1e-6)


def test_step_rows_fit_the_decode_and_prefill_costs():
    rows = []
    for batch, ctx in itertools.product((1, 4, 16, 32), (64, 256, 1024)):
        steps = 8
        keys = batch * (ctx + 1 + ctx + steps) / 2
        step_passes = ("passes", "rows") if batch <= SPLIT else ("wide_passes", "wide_rows")
        rows.append({"batch": batch, "ctx": ctx, "decode_tokens": steps,
                     "decode_step_s": TRUE[step_passes[0]] + TRUE[step_passes[1]] * batch + 2e-8 * keys,
                     "prefill_s": TRUE["wide_passes"] + TRUE["wide_rows"] * batch * ctx + 1e-9 * batch * ctx * (ctx + 1) / 2})
    fitted = fit(step_observations(pd.DataFrame(rows), CONTIGUOUS, SPLIT), "step rows")
    expected = {**TRUE, "iteration": 0.0, "decodes": 0.0, "decode_keys": 2e-8}
    for name, value in expected.items():
        assert fitted.coefficients[name] == pytest.approx(value, rel=1e-6, abs=1e-15)
    assert fitted.merged == ("iteration",) and fitted.unobserved == ()  # one pass a step: its fixed cost is the pass's


def test_with_a_budget_that_binds_paging_serves_more_at_once_at_the_roof():
    """At the same bytes, a reservation holds prompt + max_tokens per request; blocks hold what is
    there: more sequences run, and the roofline throughput rises (the vLLM paper's point)."""
    per_token = int(analytic.kv_bytes_per_token(LLAMA3_70B, "bfloat16"))
    work = Workload(tuple(Request(i, 0.0, 200, 100, 2000) for i in range(64)))
    budget = 20 * 2200 * per_token  # twenty reservations
    outcomes = {}
    for name, layout, memory in [("reserved", CONTIGUOUS, SequenceMemory(per_token, ARENA, reserved=True)),
                                 ("paged", CacheLayout(block_size=16), SequenceMemory(per_token, BLOCKS, block_tokens=16))]:
        outcomes[name] = summary(simulate(work, KVMemory(memory, budget), RoofStepTime(LLAMA3_70B, "bfloat16", layout, H100, tp=8)))
    assert outcomes["reserved"]["running_batch_peak"] == 20
    assert outcomes["paged"]["running_batch_peak"] == 64
    assert outcomes["paged"]["output_throughput"] > 2 * outcomes["reserved"]["output_throughput"]


def test_the_simulated_executor_counts_what_it_ran():
    executor = SimulatedExecutor(RoofStepTime(SMALL, "float32", CONTIGUOUS, H100))
    outcome = serve(_workload(5), KVMemory(SequenceMemory(100, ARENA, reserved=True), 10**6), executor, VirtualClock())
    assert executor.iterations == len(outcome.iterations) > 0

"""What the compressed caches' decode steps buy against the exact cache, each on its C kernel and on its
torch backend, timed in the same interleaved rounds (their speed targets; docs/evidence.md has the sweep).

Every evicting policy at a 256-token budget, SnapKV over int4 slots and ThinK step through
`cpu_compacted_attention.c` / `cpu_pruned_attention.c` (backend c) and through torch's operations
(backend torch, the code path before those kernels), beside `contiguous`, with random K/V in the cache
(a step's time does not depend on the values), at two points past the crossover: `smollm2_1280`
(SmolLM2-135M's shape, random weights, batch 16, ctx 1280: the kv_compression preset's long point) and
`heavy` (tests/benchmarks/conftest.py: a 256-wide model, batch 16, 2048 tokens, the cache ~8x the
weights). The targets, on the ratios to `contiguous` measured in this run: each C step at most 10% above
its predicted ratio, and `think` faster than the exact cache. The prediction is the rule of every row's
predicted_step_s (analytic.mean_decode_step: the step's matmuls, then its attention, each at its roof)
at the roofs every row is predicted at: the runner's calibration (harness.measure.roofs), measured in
this process before the rounds.

On a 2-core AMD EPYC (Zen 4, December 2026), three runs in one hour: met at both points in the first
(calibrated roofs 46.0 GB/s and 141 GFLOP/s: SmolLM2's point, the evicting C steps 0.57-0.60x of the
exact step against 0.68x predicted, snapkv_int4 0.54x (0.64), think 0.91x (0.92); the heavy point
0.33-0.36x (0.34), snapkv_int4 0.28x (0.28), think 0.80x (0.85)) and at SmolLM2's point in the second
(31 GB/s, 140 GFLOP/s); not met by the evicting steps and snapkv_int4 in the third (35 GB/s, 186
GFLOP/s: SmolLM2's point 0.63-0.65x against 0.57x, snapkv_int4 0.61x against 0.49x). The measured
ratios hardly moved between the runs; the predictions did, with the calibrated roofs' ratio (3.1, 4.5,
5.3 FLOP/B): the read roof of one process's calibration moves by half between processes here, and a
10% band cannot hold through that. So this stays opt-in, out of the CI gate; the gate's check of the
same members (test_compression_rates.py) prices their bytes at the rates the exact and int4 caches'
kernels attain in the same rounds instead.

Run: `python -m pytest -m target tests/benchmarks/test_compression_targets.py -s` (prints every figure).
"""
from __future__ import annotations

import functools

import pytest
import torch

from harness.analysis import analytic
from harness.measure.roofs import measure_within
from harness.measure.rounds import RoundsOptions, time_rounds
from strategies import StrategyUnavailable
from strategies.caches.contiguous import ContiguousStrategy
from strategies.caches.think import ThinKStrategy
from tests.benchmarks.conftest import DTYPE, MATMUL, POINTS, BenchPoint, filled_session, smollm2_shape
from tests.test_eviction import variant

pytestmark = pytest.mark.target  # opt-in (`pytest -m target`, docs/benchmarking.md): why not gated, the docstring
DTYPE_NAME = str(DTYPE).removeprefix("torch.")
# The kv_compression preset's long point, and the suite's cache-dominated one.
TARGET_POINTS = {"smollm2_1280": BenchPoint("smollm2_1280", smollm2_shape(), batch=16, ctx=1280, prefill="random"),
                 "heavy": POINTS["heavy"]}
ROUNDS = 15
# The shipped variants (conf/strategy/<name>.yaml: budgets of 256 tokens) and ThinK.
COMPRESSED = {**{name: (lambda backend, n=name: variant(n, backend=backend))
                 for name in ("streaming", "h2o", "snapkv", "tova", "snapkv_int4")},
              "think": lambda backend: ThinKStrategy(backend=backend)}
BACKENDS = ("c", "torch")  # after (the kernels), before (torch's operations)
CALIBRATION_BUDGET_S = 40.0  # a cap: each kernel stops after its 10 repeats, well within it here


@functools.cache
def calibrated_roofs() -> analytic.Roof:
    """The runner's calibration (the roofs of every row's predicted_step_s), measured once per process."""
    calibration = measure_within(("cpu", DTYPE_NAME, CALIBRATION_BUDGET_S, MATMUL == "c"))
    return analytic.Roof(flops_per_s=calibration.matmul_flops, bytes_per_s=calibration.read_bandwidth_Bps)


def predicted_ratio(point: BenchPoint, strategy, roof: analytic.Roof) -> float:
    """The analytic model's step time over the exact cache's at the point, at the calibrated roofs: its
    matmuls and its attention, each the larger of its bytes over the read roof and its FLOPs over the
    FLOP roof, summed (analytic.mean_decode_step, the rule of every row's predicted_step_s). The bytes'
    ratio alone would price the linears, which every member runs and which batch 16 makes
    compute-bound, at the read rate."""
    def step_s(layout):
        return analytic.mean_decode_step(point.shape, DTYPE_NAME, point.batch, point.ctx, 1, layout, roof).seconds
    return step_s(strategy.cache_layout(point.shape)) / step_s(ContiguousStrategy().cache_layout(point.shape))


CONTENTION_LIMIT = 0.05  # others took more of the CPUs during the rounds: inconclusive, as in harness.bench.gate


def timed_members(point: BenchPoint, model, members: dict, reference: str | None = None):
    """One set of ROUNDS interleaved rounds of each member's decode step, `members` being name ->
    (strategy, tokens its session holds before the step); the point skips where a member cannot run on
    this CPU, and is inconclusive (skips) where other processes took more than CONTENTION_LIMIT of the CPUs."""
    steps = {}
    for name, (strategy, ctx) in members.items():
        try:
            strategy.kernel(torch.device("cpu"), DTYPE, point.shape)
        except StrategyUnavailable as unavailable:
            pytest.skip(f"{name} cannot run on this CPU: {unavailable}")
        session, token = filled_session(strategy, model, point.batch, ctx, ROUNDS + 2)
        steps[name] = lambda s=session, t=token: s.step(t)
    rounds = time_rounds(steps, RoundsOptions(rounds=ROUNDS, reference=reference))
    if rounds.contention is not None and rounds.contention > CONTENTION_LIMIT:
        pytest.skip(f"inconclusive: other processes took {rounds.contention:.0%} of the CPUs during the rounds")
    return rounds


@pytest.fixture(scope="module", params=list(TARGET_POINTS))
def ratios(request, model_for):
    """At each point: each member's median step over contiguous's, and its predicted ratio, from one set of
    rounds; the point's name with them."""
    point = TARGET_POINTS[request.param]
    roof = calibrated_roofs()  # before the model and sessions are built: the calibration reads ~1.5 GB
    model = model_for(point.shape, point.batch)
    members = {"contiguous": ContiguousStrategy()}
    members.update({f"{name}/{backend}": make(backend) for name, make in COMPRESSED.items() for backend in BACKENDS})
    rounds = timed_members(point, model, {name: (strategy, point.ctx) for name, strategy in members.items()})
    medians = rounds.medians()
    others = "unread" if rounds.contention is None else f"{rounds.contention:.0%}"
    print(f"\n{point.name} B={point.batch} ctx={point.ctx}, others took {others} of the CPUs; "
          f"contiguous {medians['contiguous'] * 1e3:.2f} ms; calibrated roofs {roof.bytes_per_s / 1e9:.1f} GB/s, "
          f"{roof.flops_per_s / 1e9:.0f} GFLOP/s")
    found = {}
    for name, strategy in members.items():
        if name == "contiguous":
            continue
        found[name] = (medians[name] / medians["contiguous"], predicted_ratio(point, strategy, roof))
        print(f"{name:18s} {medians[name] * 1e3:7.2f} ms  {found[name][0]:5.3f}x contiguous  "
              f"(predicted {found[name][1]:5.3f}x)")
    return point.name, found


@pytest.mark.parametrize("name", list(COMPRESSED))
def test_a_compressed_step_is_within_ten_percent_of_its_predicted_ratio(ratios, name):
    point, found = ratios
    measured, predicted = found[f"{name}/c"]
    assert measured <= 1.1 * predicted, f"{name} at {point}: {measured:.3f}x contiguous, predicted {predicted:.3f}x"


def test_think_is_faster_than_the_exact_cache(ratios):
    point, found = ratios
    measured, _ = found["think/c"]
    assert measured < 1.0, f"think at {point}: {measured:.3f}x contiguous"

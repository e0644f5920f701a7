"""A point's key: one rule (harness.config.keys) that keeps the keys of existing points, and strategy
variants keyed as the same class and options set by hand."""
from __future__ import annotations

import dataclasses

import pytest

from harness.config import AccuracyConfig, CacheLayout, ModelConfig, Point, StrategyChoice, TimingConfig
from harness.config.point import point_from_record
from tests.conftest import planned_point

TINY = ModelConfig(name="tiny", vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=176, head_dim=16)
CONTIGUOUS = StrategyChoice(name="contiguous", strategy_class="strategies.caches.contiguous.ContiguousStrategy", backend="c",
                            caches_kv=True, exact=True, strategy_options={}, layout=CacheLayout())
QUANTIZED = StrategyChoice(name="quantized", strategy_class="strategies.caches.quantized.QuantizedStrategy", backend="c",
                           caches_kv=True, exact=False,
                           strategy_options={"format": "int4", "group_size": 32, "key_axis": "channel", "residual": 32},
                           layout=CacheLayout(value_bits=4, scale_bytes_per_token=8, residual_tokens=32))
BASE = Point(model=TINY, strategy=CONTIGUOUS, timing=TimingConfig(), batch=4, ctx=512, decode_tokens=16, device="cpu",
             dtype="float32", seed=0, prefill="compute", traffic="model", matmul="c", threads=2)
POINTS = {
    "plain": BASE,
    "interleaved": dataclasses.replace(BASE, interleave="shape"),
    "limited_hugepages_repeat": dataclasses.replace(BASE, memory_limit_bytes=400_000_000, hugepages=True, repeat=2),
    "quantized_reference": dataclasses.replace(BASE, strategy=QUANTIZED,
                                               reference="strategies.caches.contiguous.ContiguousStrategy:sdpa"),
    "checkpoint_prompt": dataclasses.replace(
        BASE, model=dataclasses.replace(TINY, name="smol", checkpoint="/models/smol", tie_embeddings=True,
                                        rope_scaling="llama3", rope_scaling_factor=8.0),
        weights="checkpoint", checkpoint_hash="0123456789abcdef", prompt="/data/text.txt", prompt_hash="fedcba9876543210"),
}
# Computed once by the code that listed the fields keyed when set by name, before the rule replaced it:
# rows written then are found by a re-run now.
KEYS_BEFORE_THE_RULE = {
    "plain": "2c4277f87340dd6d",
    "interleaved": "2c4277f87340dd6d",
    "limited_hugepages_repeat": "54c4010b2143ebc3",
    "quantized_reference": "6525390b1e50bbd5",
    "checkpoint_prompt": "8e9670a955394b82",
}


@pytest.mark.parametrize("name", POINTS)
def test_keys_of_existing_points_do_not_change(name):
    assert POINTS[name].key == KEYS_BEFORE_THE_RULE[name]


def test_a_field_at_its_default_is_left_out_and_set_it_is_keyed():
    point = POINTS["quantized_reference"]
    assert "accuracy" not in point.identity() and "interleave" not in point.identity()
    more = dataclasses.replace(point, accuracy=AccuracyConfig(tokens=4096))
    assert more.identity()["accuracy"] == {"tokens": 4096, "steps": 64, "batch": 16} and more.key != point.key
    assert point_from_record(more.identity()) == more  # the rule drops nothing a point cannot be rebuilt from


def test_a_variant_is_keyed_as_its_class_and_options_set_by_hand():
    shape = ("model=tiny", "model.d_model=128", "ctx=16", "decode_tokens=2")
    variant = planned_point(*shape, "strategy=kivi4")
    by_hand = planned_point(*shape, "strategy=quantized", "strategy.format=int4", "strategy.key_axis=channel",
                            "strategy.residual=32")
    assert variant.key == by_hand.key
    assert variant.strategy.variant == "kivi4"
    assert by_hand.strategy.variant == "quantized(format=int4,key_axis=channel,residual=32)"
    assert planned_point(*shape, "strategy=paged32").key == planned_point(*shape, "strategy=paged",
                                                                          "strategy.block_size=32").key


def test_a_class_keeps_its_key_when_it_moves_into_a_kind_package():
    """Sorting the strategies into strategies/caches and strategies/engines moved every class: the key
    hashes the path without the kind, so a row measured before the move is found by a re-run after it."""
    path_before = CONTIGUOUS.strategy_class.replace("caches.", "")  # where the class lived before
    before = dataclasses.replace(CONTIGUOUS, strategy_class=path_before)
    moved, old = dataclasses.replace(BASE, strategy=CONTIGUOUS), dataclasses.replace(BASE, strategy=before)
    assert moved.key == old.key and moved.group_key() == old.group_key()
    assert moved.identity()["strategy"]["strategy_class"] == "strategies.caches.contiguous.ContiguousStrategy"
    assert moved.identity(hashed=True)["strategy"]["strategy_class"] == path_before

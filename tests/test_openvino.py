"""OpenVINO as a group member (strategies/engines/openvino.py) on a tiny GGUF model: its rows beside the exact
cache, the f32 member agreeing with it, u8 and u4 scored by the accuracy pass, a rewind that repeats a
step, an A/A pair of one OpenVINO member (device=cpu throughout). What needs no wheel: its KV types and
the skipped row naming the pip command. Skipped, with the command, where the wheel is not installed."""
from __future__ import annotations

import dataclasses
import importlib.util
import sys

import pytest
import torch

from harness.config import ConfigError
from strategies.backends import StrategyUnavailable
from strategies.engines.openvino import CRASHES, OpenVINOStrategy
from tests.conftest import planned_point
from tests.peer_checks import aa_pair_ratio
from tests.gguf_files import CONFIG, Q, byte_level_vocab, random_weights, write_gguf

HAS_WHEEL = importlib.util.find_spec("openvino") is not None
needs_wheel = pytest.mark.skipif(not HAS_WHEEL, reason="the OpenVINO wheel is not installed: pip install -e '.[peers]'")
CPU = torch.device("cpu")


def test_f32_is_held_to_the_exact_cache_and_the_quantized_types_are_scored():
    assert OpenVINOStrategy(kv_type="f32").agreement() is not None
    assert OpenVINOStrategy(kv_type="u8").agreement() is None
    assert [OpenVINOStrategy(kv_type=kind).cache_layout().value_bits for kind in ("f32", "u8", "u4")] == [0, 8, 4]
    with pytest.raises(ConfigError, match="strategy.kv_type.*f32, u8, u4"):
        OpenVINOStrategy(kv_type="q8_0")


def test_without_its_wheel_it_is_a_skipped_row_naming_the_pip_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "openvino", None)
    monkeypatch.setattr("strategies.engines.engine._importable", lambda package: False)
    strategy = OpenVINOStrategy(kv_type="u8")
    with pytest.raises(StrategyUnavailable, match=r"pip install -e '\.\[peers\]'"):
        strategy.kernel(CPU, torch.float32)
    assert strategy.row_columns() == {"engine": "OpenVINO", "step_granularity": "token", "engine_version": None,
                                      "engine_kv_type": "u8", "engine_isa": None,
                                      "engine_build": None, "engine_build_flags": None}


@pytest.fixture(scope="module")
def model_file(tmp_path_factory):
    """A tiny Llama with heads 32 wide (grouped: 2 query heads per KV head)."""
    folder = tmp_path_factory.mktemp("openvino")
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(CONFIG, "num_attention_heads", 2)
        patch.setitem(CONFIG, "num_key_value_heads", 1)
        return write_gguf(folder / "tiny-heads32.gguf", random_weights(len(byte_level_vocab()[0])), kind=Q.Q8_0)


def point_of(path, strategy: str, *more: str):
    return dataclasses.replace(planned_point("model=tiny", f"model.checkpoint={path}", f"strategy={strategy}", "ctx=12",
                                             "decode_tokens=4", "batch=2", "accuracy.tokens=16", "accuracy.steps=4",
                                             *more), interleave="shape")


@needs_wheel
def test_openvino_members_run_in_the_group_beside_the_exact_cache(model_file):
    from harness.measure.group import GroupRequest, measure_group

    names = ("contiguous", "openvino_f32", "openvino_u8", "openvino_u4")
    rows = dict(zip(names, measure_group(GroupRequest("openvino", tuple(point_of(model_file, n) for n in names)))))
    for name in names[1:]:
        row = rows[name]
        if name.removeprefix("openvino_") in CRASHES and row["engine_version"] == "OpenVINO 2026.4.1":
            assert row["status"] == "skipped" and row["reason"] == CRASHES["u4"], row["reason"]
            continue
        assert row["status"] == "ok", row["reason"]
        assert row["engine"] == "OpenVINO" and row["step_granularity"] == "token"
        assert row["engine_kv_type"].startswith(name.removeprefix("openvino_"))
        assert row["engine_version"].startswith("OpenVINO 20") and "CPU plugin JIT" in row["engine_isa"]
        assert row["ratio_ci_low"] <= row["ratio_to_reference"] <= row["ratio_ci_high"]
        assert row["accuracy_tokens"] == 16 and row["logit_kl_mean"] >= 0
    exact = rows["openvino_f32"]
    assert exact["agreement_logit_rel"] <= exact["agreement_logit_rel_bound"]
    assert exact["logit_kl_mean"] < exact["agreement_kl_mean_bound"]
    assert rows["openvino_u8"]["agreement_logit_rel"] is None  # approximate: scored, not held to a bound
    if rows["openvino_u4"]["status"] == "ok":
        assert rows["openvino_u4"]["logit_kl_mean"] > rows["openvino_u8"]["logit_kl_mean"]
    assert rows["openvino_u8"]["kv_cache_bytes"] < exact["kv_cache_bytes"]


@needs_wheel
@pytest.mark.parametrize("kv_type", ["f32", "u8"])
def test_a_rewind_repeats_the_step(model_file, kv_type):
    from harness.model import build_model
    from harness.model.checkpoint import read_checkpoint

    model = build_model(read_checkpoint(model_file).shape, CPU, torch.float32, 0, "aten")
    session = OpenVINOStrategy(kv_type=kv_type).new_session(model, 2, 16)
    first = session.prefill(torch.tensor([[5, 9, 30, 2, 7], [1, 2, 3, 4, 5]])).argmax(-1)
    step = session.step(first)
    session.step(step.argmax(-1))
    session.rewind(5)
    assert session.length == 5
    torch.testing.assert_close(session.step(first), step, rtol=0, atol=1e-5 * step.abs().max().item())


@needs_wheel
@pytest.mark.slow
@pytest.mark.serial  # a paired ratio: another process on the CPUs makes it skip as busy
def test_an_aa_pair_of_one_openvino_member_reads_one(model_file):
    """Two identical OpenVINO members in one group: the ratio's interval holds 1 (tests.peer_checks)."""
    ratio = aa_pair_ratio(point_of(model_file, "openvino_f32", "decode_tokens=32"), point_of(model_file, "contiguous"))
    assert ratio.low < 1.0 < ratio.high or 0.9 < ratio.median < 1.1, ratio


@needs_wheel
def test_its_threads_sleep_once_a_step_has_returned(model_file):
    """The direct form of the A/A pair: CPU time the process burns while it waits after an OpenVINO step
    (a pool that spun between steps would burn its threads' share of the wait)."""
    import time

    from harness.model import build_model
    from harness.model.checkpoint import read_checkpoint

    model = build_model(read_checkpoint(model_file).shape, CPU, torch.float32, 0, "aten")
    session = OpenVINOStrategy(kv_type="f32").new_session(model, 2, 64)
    token = session.prefill(torch.tensor([[5, 9, 30, 2, 7], [1, 2, 3, 4, 5]])).argmax(-1)
    time.sleep(0.5)  # torch's own OpenMP workers stop spinning after the model's build
    burnt = []
    for _ in range(5):
        token = session.step(token).argmax(-1)
        before = time.process_time()
        time.sleep(0.2)
        burnt.append(time.process_time() - before)
    # a spinning pool of even one thread burns ~0.2 s of each wait; a sleeping one a few milliseconds
    assert min(burnt) < 0.05, burnt

"""llama.cpp as a group member (strategies/engines/llamacpp.py) on a tiny GGUF model: its rows, its agreement
with the exact cache at full precision, its quantized KV scored by the accuracy pass, a rewind that
repeats a step exactly, and an A/A pair of one llama.cpp member reading a ratio whose interval holds 1
(device=cpu throughout). Skipped, with the command, where the wheel is not installed."""
from __future__ import annotations

import dataclasses
import importlib.util

import pytest
import torch

from harness.measure.group import GroupRequest, measure_group
from harness.model import build_model
from harness.model.checkpoint import read_checkpoint
from tests.conftest import planned_point
from tests.gguf_files import CONFIG, Q, byte_level_vocab, random_weights, write_gguf
from tests.peer_checks import aa_pair_ratio

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llama_cpp_py_sync") is None,
                                reason="the llama.cpp wheel is not installed: pip install -e '.[peers]'")
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def model_file(tmp_path_factory):
    """A tiny Llama with heads 32 wide: llama.cpp's q8_0 and q4_0 blocks of 32 divide them."""
    folder = tmp_path_factory.mktemp("llamacpp")
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(CONFIG, "num_attention_heads", 2)
        patch.setitem(CONFIG, "num_key_value_heads", 1)
        return write_gguf(folder / "tiny-heads32.gguf", random_weights(len(byte_level_vocab()[0])), kind=Q.Q8_0)


@pytest.fixture(scope="module")
def narrow_heads_file(tmp_path_factory):
    """The tests' usual tiny Llama, heads 16 wide."""
    return write_gguf(tmp_path_factory.mktemp("llamacpp16") / "tiny-heads16.gguf",
                      random_weights(len(byte_level_vocab()[0])), kind=Q.Q8_0)


def point_of(path, strategy: str, *more: str):
    return dataclasses.replace(planned_point("model=tiny", f"model.checkpoint={path}", f"strategy={strategy}", "ctx=12",
                                             "decode_tokens=4", "batch=2", "accuracy.tokens=16", "accuracy.steps=4",
                                             *more), interleave="shape")


def test_llamacpp_members_run_in_the_group_beside_the_exact_cache(model_file):
    names = ("contiguous", "llamacpp_f16", "llamacpp_q8_0", "llamacpp_q4_0")
    rows = dict(zip(names, measure_group(GroupRequest("llamacpp", tuple(point_of(model_file, n) for n in names)))))
    for name in names[1:]:
        row = rows[name]
        assert row["status"] == "ok", row["reason"]
        assert row["engine"] == "llama.cpp" and row["step_granularity"] == "token"
        assert row["engine_kv_type"] == name.removeprefix("llamacpp_")
        # the wheel's release tag, or this machine's build (tests/test_llamacpp_build.py runs both)
        assert row["engine_version"].startswith({"wheel": "b", "built here": "llama.cpp "}[row["engine_build"]])
        assert "AVX" in row["engine_isa"] or "NEON" in row["engine_isa"]
        assert row["ratio_ci_low"] <= row["ratio_to_reference"] <= row["ratio_ci_high"]
        assert row["accuracy_tokens"] == 16 and row["logit_kl_mean"] >= 0
    full = rows["llamacpp_f16"]
    assert full["agreement_logit_rel"] <= full["agreement_logit_rel_bound"]
    assert full["logit_kl_mean"] < full["agreement_kl_mean_bound"]
    assert rows["llamacpp_q8_0"]["agreement_logit_rel"] is None  # approximate: scored, not held to a bound
    assert rows["llamacpp_q4_0"]["logit_kl_mean"] > rows["llamacpp_q8_0"]["logit_kl_mean"]
    bytes_f16, bytes_q8 = rows["llamacpp_f16"]["kv_cache_bytes"], rows["llamacpp_q8_0"]["kv_cache_bytes"]
    assert bytes_q8 == pytest.approx(bytes_f16 * 34 / 64)


def test_a_rewind_repeats_the_step(model_file):
    from strategies.engines.llamacpp import LlamaCppStrategy

    model = build_model(read_checkpoint(model_file).shape, CPU, torch.float32, 0, "aten")
    session = LlamaCppStrategy(kv_type="f32").new_session(model, 2, 16)
    first = session.prefill(torch.tensor([[5, 9, 30, 2, 7], [1, 2, 3, 4, 5]])).argmax(-1)
    step = session.step(first)
    session.step(step.argmax(-1))
    session.rewind(5)
    assert session.length == 5 and torch.equal(session.step(first), step)


def test_a_kv_type_the_engine_refuses_at_a_shape_is_a_skipped_row_with_its_reason(narrow_heads_file):
    _, row = measure_group(GroupRequest("narrow", (point_of(narrow_heads_file, "contiguous"),
                                                   point_of(narrow_heads_file, "llamacpp_q8_0"))))
    assert row["status"] == "skipped" and "does not divide n_embd_head_k=16" in row["reason"], row["reason"]


def test_a_batch_beyond_the_engines_sequences_is_a_skipped_row(model_file):
    from strategies.engines.artifacts.llamacpp_library import load

    limit = int(load().lib.llama_max_parallel_sequences())
    _, row = measure_group(GroupRequest("wide", (point_of(model_file, "contiguous", f"batch={limit + 1}", "ctx=4"),
                                                 point_of(model_file, "llamacpp_f16", f"batch={limit + 1}", "ctx=4"))))
    assert row["status"] == "skipped" and "llama.cpp" in row["reason"], row["reason"]


@pytest.mark.slow
@pytest.mark.serial  # a paired ratio: another process on the CPUs makes it skip as busy
def test_an_aa_pair_of_one_llamacpp_member_reads_one(model_file):
    """Two identical llama.cpp members in one group: if its threads spun while the other ran, the
    second of each pair would pay for it; the ratio's interval holds 1."""
    # A spinning pool makes the second of every pair pay, round after round: an interval clear of 1 by
    # more than a few percent. Sub-millisecond steps of a tiny model spread widely, so the test holds
    # to the interval (CI saw a median of 0.73 in [0.49, 1.09] for a sound pair).
    ratio = aa_pair_ratio(point_of(model_file, "llamacpp_f16", "decode_tokens=32"), point_of(model_file, "contiguous"))
    assert ratio.low < 1.0 < ratio.high or 0.9 < ratio.median < 1.1, ratio

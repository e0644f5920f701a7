"""Peers (strategies/engines/engine.py): an engine as a member of a group, on a fake engine that runs everywhere
(tests/plugin/fake_engine.py); the engine's copy of the weights (strategies/engines/artifacts/gguf_writer.py) read
back; a missing wheel as a skipped row naming the pip command; a disagreeing engine as a failed row,
never a timed one (device=cpu throughout)."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import gguf
import numpy as np
import pandas as pd
import pytest
import torch

from harness.measure.group import GroupRequest, measure_group
from harness.report.document import Table
from harness.report.engines import HOW_TO, engine_section
from harness.run.row import build_row
from harness.model import build_model
from harness.model.checkpoint import read_checkpoint
from harness.model.checkpoint_fields import CheckpointError
from strategies.engines.artifacts.gguf_writer import float_gguf
from tests.conftest import planned_point, refused_by_runner
from tests.gguf_files import Q, byte_level_vocab, random_weights, write_folder, write_gguf

PLUGIN = f"hydra.searchpath=[file://{Path(__file__).parent / 'plugin' / 'conf'}]"
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def quantized_file(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("peers")
    return write_gguf(folder / "tiny-q8.gguf", random_weights(len(byte_level_vocab()[0])), kind=Q.Q8_0)


@pytest.fixture(scope="module")
def engine_cache(tmp_path_factory, monkeypatch_module):
    folder = tmp_path_factory.mktemp("engine-cache")
    monkeypatch_module.setenv("HARNESS_KERNEL_CACHE", str(folder))
    return folder


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


@pytest.mark.parametrize("kind", ["F32", "F16"])
def test_the_engines_copy_holds_the_decoders_weights_under_the_same_names(quantized_file, tmp_path, kind):
    written = float_gguf(quantized_file, kind, folder=tmp_path)
    assert float_gguf(quantized_file, kind, folder=tmp_path) == written  # cached: written once
    source, copy = gguf.GGUFReader(quantized_file), gguf.GGUFReader(written)
    assert [t.name for t in copy.tensors] == [t.name for t in source.tensors]
    for original, stored in zip(source.tensors, copy.tensors):
        assert stored.tensor_type.name == (kind if len(original.shape) > 1 else "F32")
        expected = gguf.quants.dequantize(original.data, original.tensor_type)  # q/k rows as stored: not unpermuted
        tolerance = 0 if kind == "F32" else 1e-3 * np.abs(expected).max()
        np.testing.assert_allclose(gguf.quants.dequantize(stored.data, stored.tensor_type), expected, atol=tolerance)
    for key, field in source.fields.items():
        if not key.startswith("GGUF.") and key != "general.file_type":
            assert copy.fields[key].contents() == field.contents(), key
    assert copy.fields["general.file_type"].contents() == (0 if kind == "F32" else 1)
    # the decoder built from the copy computes what the decoder built from the source does
    source_model, copy_model = (build_model(read_checkpoint(path).shape, CPU, torch.float32, 0, "aten")
                                for path in (quantized_file, written))
    tokens = torch.tensor([[1, 5, 9, 30, 2]])
    with torch.inference_mode():
        from strategies.caches.contiguous import ContiguousStrategy

        logits = [ContiguousStrategy(backend="sdpa").new_session(m, 1, 8).prefill(tokens) for m in (source_model, copy_model)]
    torch.testing.assert_close(logits[1], logits[0], rtol=0, atol=0 if kind == "F32" else 5e-2)


def test_an_engines_copy_needs_a_gguf_file(tmp_path):
    folder = write_folder(tmp_path / "hf", random_weights(len(byte_level_vocab()[0])))
    with pytest.raises(CheckpointError, match="written from a GGUF file"):
        float_gguf(folder, folder=tmp_path)


def point_of(path: Path, strategy: str, *more: str):
    return dataclasses.replace(planned_point(PLUGIN, "model=tiny", f"model.checkpoint={path}", f"strategy={strategy}",
                                             "ctx=8", "decode_tokens=4", "accuracy.tokens=16", "accuracy.steps=4",
                                             *more), interleave="shape")


@pytest.fixture(scope="module")
def group(quantized_file, engine_cache):
    names = ("contiguous", "fake_engine", "fake_missing_engine")
    points = [point_of(quantized_file, name) for name in names]
    points.append(point_of(quantized_file, "fake_engine", "strategy.kv_type=noisy"))
    rows = measure_group(GroupRequest("peers", tuple(points)))
    built = pd.DataFrame([build_row(point, row) for point, row in zip(points, rows)])
    return {**dict(zip((*names, "noisy"), rows)), "table": built}


def test_a_peer_is_a_member_of_the_group_with_its_engine_columns(group):
    peer, ours = group["fake_engine"], group["contiguous"]
    assert peer["status"] == "ok", peer["reason"]
    assert peer["group_reference"] == "contiguous" and peer["rounds"] == ours["rounds"]
    assert peer["ratio_ci_low"] <= peer["ratio_to_reference"] <= peer["ratio_ci_high"]
    assert (peer["engine"], peer["engine_version"], peer["engine_kv_type"], peer["engine_isa"],
            peer["step_granularity"]) == ("fake", "fake 1.0", "f32", "the harness's", "token")
    assert (peer["engine_build"], peer["engine_build_flags"]) == ("built here", "the harness's decoder behind another object")
    assert peer["kernel"] == "fake engine (f32 KV)"
    assert ours.get("engine") is None and ours["agreement_logit_rel"] is None
    # the same weights, through the engine's copy: the agreement check measured it, within bound
    assert peer["agreement_logit_rel"] <= peer["agreement_logit_rel_bound"] and peer["agreement_logit_max_abs"] < 1e-4
    assert peer["tokens_digest"] == ours["tokens_digest"]
    # the accuracy pass scored it on the same windows, and its KL is within the stated bound
    assert peer["accuracy_tokens"] == 16 and peer["logit_kl_mean"] < peer["agreement_kl_mean_bound"]


def test_the_agreement_check_reuses_the_exact_members_first_step_and_needs_none(quantized_file, engine_cache, monkeypatch):
    """With the exact cache in the group (listed after the engine: it is set up first all the same), the
    check's reference step is that member's: no prefill of the reference's own. Without it, the point's
    reference prefills, and the check reads the same."""
    from harness.measure import agreement

    built = []  # the reference's prompts run for the check (the accuracy pass builds its own reference)
    start_decode = agreement.start_decode
    monkeypatch.setattr(agreement, "start_decode", lambda point, *more: built.append(point) or start_decode(point, *more))
    shared = measure_group(GroupRequest("shared", (point_of(quantized_file, "fake_engine"),
                                                   point_of(quantized_file, "contiguous"))))[0]
    assert shared["status"] == "ok" and built == []
    alone = measure_group(GroupRequest("alone", (point_of(quantized_file, "fake_engine"),)))[0]
    assert alone["status"] == "ok" and built
    assert alone["agreement_logit_max_abs"] < 1e-4 and shared["agreement_logit_max_abs"] < 1e-4


def test_a_missing_engine_is_a_skipped_row_naming_the_pip_command(group):
    row = group["fake_missing_engine"]
    assert row["status"] == "skipped" and "pip install -e '.[peers]'" in row["reason"]
    assert row["engine"] == "fake" and row["engine_version"] is None


def test_a_disagreeing_engine_fails_untimed_naming_the_difference(group):
    row = group["noisy"]
    assert row["status"] == "failed" and row["reason"].startswith("Disagreement: first-step logits differ")
    assert row["agreement_logit_rel"] > row["agreement_logit_rel_bound"]
    assert row.get("decode_step_s") is None


def test_a_batch_the_engine_refuses_is_a_skipped_row_with_its_reason(quantized_file, engine_cache):
    points = (point_of(quantized_file, "contiguous", "batch=9"), point_of(quantized_file, "fake_engine", "batch=9"))
    _, peer = measure_group(GroupRequest("wide", points))
    assert peer["status"] == "skipped" and peer["reason"] == "fake engine: batch 9 > its 8 sequences"


def test_a_peer_refuses_random_weights_and_random_prefill_in_one_line(quantized_file):
    assert refused_by_runner(PLUGIN, "model=tiny", "strategy=fake_engine").startswith("error: model.checkpoint:")
    assert refused_by_runner(PLUGIN, "model=tiny", f"model.checkpoint={quantized_file}", "strategy=fake_engine",
                             "prefill=random").startswith("error: prefill:")


def test_the_report_sets_the_engine_beside_the_exact_cache(group):
    blocks = engine_section(group["table"])
    tables = [block for block in blocks if isinstance(block, Table)]
    steps, target, accuracy, not_run = tables
    assert [row[2] for row in steps.rows] == ["contiguous", "fake_engine"]
    assert steps.rows[1][3:5] == ["fake (built here)", "f32"] and steps.rows[0][7] == "reference"  # which build ran
    assert target.rows[0][2] == "fake_engine" and target.rows[0][6] in ("harness faster", "harness slower",
                                                                       "tie (interval covers 1)")
    assert [row[1] for row in accuracy.rows] == ["fake_engine"]  # scored on the windows, with its agreement
    assert accuracy.rows[0][8].endswith(f"(≤ {group['fake_engine']['agreement_logit_rel_bound']:g}; "
                                        f"KL ≤ {group['fake_engine']['agreement_kl_mean_bound']:g})")
    assert {row[0] for row in not_run.rows} == {"fake_missing_engine", "fake_engine(kv_type=noisy)"}
    assert engine_section(group["table"].iloc[0:1])[1].text == HOW_TO  # no engine member: how to measure one


def test_llamacpp_without_its_wheel_is_a_skipped_row_naming_the_pip_command(monkeypatch):
    """Whether or not the wheel is installed here: the module hidden, as on a machine without it."""
    import sys

    from strategies.backends import StrategyUnavailable
    from strategies.engines.llamacpp import LlamaCppStrategy

    monkeypatch.setitem(sys.modules, "llama_cpp_py_sync", None)
    strategy = LlamaCppStrategy(kv_type="q8_0")
    with pytest.raises(StrategyUnavailable, match=r"pip install -e '\.\[peers\]'"):
        strategy.kernel(CPU, torch.float32)
    assert strategy.row_columns() == {"engine": "llama.cpp", "step_granularity": "token", "engine_version": None,
                                      "engine_kv_type": "q8_0", "engine_isa": None,
                                      "engine_build": None, "engine_build_flags": None}

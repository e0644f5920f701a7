"""Bad checkpoints and prompt files: one line naming the key and the file, exit code 2, nothing written.

Each case breaks one thing of a good saved checkpoint (tests.test_checkpoint.save_family) and is
refused by the plan, before anything runs.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from harness.config.validate import ConfigError
from harness.run.plan import plan
from tests.conftest import refused_by_runner

transformers = pytest.importorskip("transformers")

from tests.test_checkpoint import save_family  # noqa: E402 (needs transformers)

NO_CUDA = lambda: False  # noqa: E731


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("good") / "tiny-llama"
    save_family("llama", folder)
    return folder


@pytest.fixture
def copy(good, tmp_path) -> Path:
    folder = tmp_path / "broken"
    shutil.copytree(good, folder)
    return folder


def refused(*overrides: str) -> str:
    with pytest.raises(ConfigError) as error:
        plan(["device=cpu", "model=tiny", "ctx=8", "decode_tokens=2", *overrides], cuda_available=NO_CUDA)
    message = str(error.value)
    assert "\n" not in message
    return message


def edit_config(folder: Path, **changes) -> None:
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))


def test_the_good_checkpoint_plans(good):
    point = plan(["device=cpu", "model=tiny", f"model.checkpoint={good}", "ctx=8"], cuda_available=NO_CUDA).planned[0].point
    assert point.model.name == "tiny-llama" and point.weights == "checkpoint" and len(point.checkpoint_hash) == 16


def test_a_folder_that_is_not_a_checkpoint(tmp_path):
    message = refused(f"model.checkpoint={tmp_path}")
    assert message.startswith("model.checkpoint:") and "config.json" in message


def test_no_such_folder(tmp_path):
    assert refused(f"model.checkpoint={tmp_path / 'nowhere'}").startswith("model.checkpoint:")


def test_a_truncated_safetensors_file(copy):
    weights = copy / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    message = refused(f"model.checkpoint={copy}")
    assert message.startswith("model.checkpoint:") and "model.safetensors" in message and "truncated" in message


def test_a_config_that_contradicts_the_tensors(copy):
    edit_config(copy, intermediate_size=128)
    message = refused(f"model.checkpoint={copy}")
    assert "contradicts" in message and "mlp" in message and "model.safetensors" in message


def test_another_architecture(copy):
    edit_config(copy, architectures=["GPT2LMHeadModel"], model_type="gpt2")
    message = refused(f"model.checkpoint={copy}")
    assert "GPT2LMHeadModel" in message and "config.json" in message


def test_a_quantized_checkpoint(copy):
    edit_config(copy, quantization_config={"quant_method": "bitsandbytes"})
    assert "quantized" in refused(f"model.checkpoint={copy}")


def test_a_missing_tensor(copy):
    from safetensors.torch import load_file, save_file

    tensors = load_file(copy / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, copy / "model.safetensors", metadata={"format": "pt"})
    assert "model.layers.1.self_attn.k_proj.weight is missing" in refused(f"model.checkpoint={copy}")


def test_a_sliding_window_the_point_passes(copy):
    edit_config(copy, architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=8)
    assert refused(f"model.checkpoint={copy}").startswith("ctx:")


def test_a_checkpoint_larger_than_free_memory(good, monkeypatch):
    import harness.run.inputs

    monkeypatch.setattr(harness.run.inputs, "available_bytes", lambda device: 1000)
    message = refused(f"model.checkpoint={good}")
    assert message.startswith("model.checkpoint:") and "GiB of memory is free" in message


def test_a_bias_checkpoint_refuses_a_bias_free_matmul(tmp_path):
    save_family("qwen2", tmp_path)
    assert refused(f"model.checkpoint={tmp_path}", "matmul=c").startswith("matmul:")


def test_a_prompt_file_too_short(good, tmp_path):
    path = tmp_path / "ids.json"
    path.write_text(json.dumps(list(range(20))))
    message = refused(f"model.checkpoint={good}", f"prompt={path}", "batch=2")
    assert message.startswith("prompt:") and "ids.json" in message and "22" in message


def test_prompt_ids_outside_the_vocabulary(tmp_path):
    path = tmp_path / "ids.npy"
    np.save(path, np.arange(1000, 1011))
    assert "outside the model's vocabulary" in refused(f"prompt={path}")


def test_a_text_prompt_needs_a_tokenizer(tmp_path):
    path = tmp_path / "text.txt"
    path.write_text("plain words")
    assert "tokenizer" in refused(f"prompt={path}")


def test_with_a_random_fill_a_prompt_file_feeds_only_the_accuracy_pass(tmp_path):
    """prefill=random runs no prompt, so the file need not hold the timed windows (batch x (ctx +
    decode_tokens + 1) tokens); an approximate strategy's accuracy pass still needs its text."""
    path = tmp_path / "ids.json"
    path.write_text(json.dumps(list(range(15))))  # fewer than 2 x (8 + 2 + 1) tokens
    assert refused(f"prompt={path}", "batch=2").startswith("prompt:")
    point = plan(["device=cpu", "model=tiny", "ctx=8", "decode_tokens=2", f"prompt={path}", "batch=2", "prefill=random"],
                 cuda_available=NO_CUDA).planned[0].point
    assert point.prefill == "random" and point.prompt_hash is not None
    assert refused(f"prompt={path}", "prefill=random", "strategy=int8", "accuracy.tokens=64").startswith("accuracy.tokens:")


def test_the_cli_refuses_in_one_line_and_writes_nothing(copy, tmp_path):
    (copy / "model.safetensors").write_bytes(b"\x00" * 4)
    results = tmp_path / "results"
    line = refused_by_runner("device=cpu", "model=tiny", f"model.checkpoint={copy}", f"results_dir={results}")
    assert line.startswith("error: model.checkpoint:") and "model.safetensors" in line
    assert not results.exists() or not any(results.rglob("*.parquet"))


def test_a_checkpoint_changed_after_planning_fails_its_point(copy):
    """The plan hashed the folder; the point's process finds another hash and refuses to measure."""
    import torch

    from harness.measure.decoding import start_decode
    from harness.model.checkpoint import CheckpointError

    point = plan(["device=cpu", "model=tiny", f"model.checkpoint={copy}", "ctx=8", "decode_tokens=2"],
                 cuda_available=NO_CUDA).planned[0].point
    edit_config(copy, rms_norm_eps=1e-5)  # still a valid checkpoint, other weights' behaviour
    with pytest.raises(CheckpointError, match="changed since the sweep was planned"):
        start_decode(point, lambda: None, torch.Generator().manual_seed(0))

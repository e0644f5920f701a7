"""A GGUF file's RoPE scaling read by llama.cpp's rules (harness.model.gguf_rope): linear scaling from
rope.scaling.factor or the legacy rope.scale_linear (no type: linear), none for type `none`, and Llama
3.1's frequency factors (rope_freqs.weight) turned back into the llama3 parameters the Hugging Face path
reads from config.json, the logits then transformers' own; every other RoPE feature refused in one line."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from harness.config.validate import ConfigError
from harness.model import build_model
from harness.model.checkpoint import read_checkpoint
from harness.model.decoder import rope_inverse_frequencies
from tests.conftest import STRATEGIES, planned_point
from tests.gguf_files import CONFIG, byte_level_vocab, random_weights, write_folder, write_gguf

transformers = pytest.importorskip("transformers")

CPU = torch.device("cpu")
HEAD_DIM = CONFIG["hidden_size"] // CONFIG["num_attention_heads"]
# A llama3 band wide enough at this head width (16, theta 10000) to hold three blended pairs.
BANDED = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 32.0,
          "original_max_position_embeddings": 2048}
LLAMA31 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 8192}


def converter_factors(scaling: dict, theta: float, dim: int = HEAD_DIM) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py (LlamaModel.generate_extra_tensors) stores as rope_freqs."""
    freqs = 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    factors = []
    for freq in freqs:
        wavelength = 2 * math.pi / freq
        if wavelength < old / high:
            factors.append(1)
        elif wavelength > old / low:
            factors.append(factor)
        else:
            smooth = (old / wavelength - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(factors, dtype=np.float32)


@pytest.fixture(scope="module")
def weights():
    return random_weights(len(byte_level_vocab()[0]))


def hf_folder(folder, weights, scaling: dict, theta: float):
    write_folder(folder, weights)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "rope_theta": theta, "rope_scaling": scaling,
                                                    "max_position_embeddings": 4096}))
    return folder


def logits_ours(location, ids: torch.Tensor) -> torch.Tensor:
    model = build_model(read_checkpoint(location).shape, CPU, torch.float32, seed=0, matmul="aten")
    session = STRATEGIES["no_cache"]().new_session(model, ids.shape[0], ids.shape[1])
    return session.prefill(ids)


def logits_transformers(folder, ids: torch.Tensor) -> torch.Tensor:
    model = transformers.LlamaForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        return model(ids).logits[:, -1]


@pytest.mark.parametrize("scaling,theta", [(BANDED, 10000.0), (LLAMA31, 500000.0),
                                           ({"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                             "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}, 500000.0)],
                         ids=["banded", "llama3.1", "llama3.2"])
def test_rope_frequency_factors_give_the_folders_rotation_and_transformers_logits(weights, tmp_path, scaling, theta):
    factors = converter_factors(scaling, theta)
    path = write_gguf(tmp_path / "llama31.gguf", {**weights, "rope_freqs.weight": factors},
                      metadata={"rope.freq_base": theta})
    folder = hf_folder(tmp_path / "hf", weights, scaling, theta)
    from_gguf, from_folder = read_checkpoint(path).shape, read_checkpoint(folder).shape
    assert from_gguf.rope_scaling == "llama3" and "rope_freqs.weight" not in read_checkpoint(path).tensors
    assert torch.allclose(rope_inverse_frequencies(HEAD_DIM, theta, from_gguf),
                          rope_inverse_frequencies(HEAD_DIM, theta, from_folder), rtol=1e-6, atol=0)
    ids = torch.randint(300, (1, 3000), generator=torch.Generator().manual_seed(0))  # past the original context
    ours, theirs = logits_ours(path, ids), logits_transformers(folder, ids)
    assert (ours - theirs).abs().max() <= 1e-4 * theirs.abs().max()


def test_the_banded_file_gives_back_the_configs_own_parameters(weights, tmp_path):
    path = write_gguf(tmp_path / "b.gguf", {**weights, "rope_freqs.weight": converter_factors(BANDED, 10000.0)})
    shape = read_checkpoint(path).shape
    assert (shape.rope_scaling_factor, shape.rope_low_freq_factor, shape.rope_high_freq_factor,
            shape.rope_original_max_len) == (8.0, 1.0, 32.0, 2048)


@pytest.mark.parametrize("metadata,factor", [
    ({"rope.scaling.factor": 4.0}, 4.0),  # no type: llama.cpp reads it as linear
    ({"rope.scaling.type": "linear", "rope.scaling.factor": 2.5}, 2.5),
    ({"rope.scale_linear": 4.0}, 4.0),  # the legacy key
    ({"rope.scaling.type": "none", "rope.scaling.factor": 4.0}, None),  # none never scales
    ({"rope.scaling.factor": 0.0}, None),  # 0: no scaling
    ({"rope.scaling.factor": 1.0}, None),
])
def test_linear_scaling_as_llama_cpp_reads_it(weights, tmp_path, metadata, factor):
    path = write_gguf(tmp_path / "linear.gguf", weights, metadata=metadata)
    shape = read_checkpoint(path).shape
    assert shape.rope_scaling == ("linear" if factor else None)
    if factor:
        assert shape.rope_scaling_factor == factor
        folder = hf_folder(tmp_path / "hf", weights, {"rope_type": "linear", "factor": factor}, CONFIG["rope_theta"])
        ids = torch.randint(300, (1, 40), generator=torch.Generator().manual_seed(0))
        ours, theirs = logits_ours(path, ids), logits_transformers(folder, ids)
        assert (ours - theirs).abs().max() <= 1e-4 * theirs.abs().max()


def refused(path) -> str:
    with pytest.raises(ConfigError) as error:
        planned_point("model=tiny", "ctx=8", "decode_tokens=2", f"model.checkpoint={path}")
    message = str(error.value)
    assert "\n" not in message and message.startswith("model.checkpoint:") and str(path) in message
    return message


@pytest.mark.parametrize("metadata,factors,says", [
    ({"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0}, None, "rope.scaling.type = 'yarn'"),
    ({"rope.scaling.type": "longrope"}, None, "RoPE scaling of a kind"),
    ({"rope.scaling.type": "sideways"}, None, "RoPE scaling of a kind"),
    ({"rope.scaling.attn_factor": 0.5}, None, "scaled attention"),
    ({"rope.scaling.factor": -2.0}, None, "rope.scaling.factor must be a finite number >= 0"),
    ({"rope.scaling.factor": "four"}, None, "got 'four'"),
    ({"rope.scaling.factor": 4.0}, "llama3", "together"),
    ({}, "random", "does not give"),
    ({}, "short", "holds 3 factors"),
    ({}, "zero", "does not give"),
    ({}, "nan", "does not give"),
])
def test_rope_features_the_decoder_does_not_compute_are_refused(weights, tmp_path, metadata, factors, says):
    stored = {"llama3": converter_factors(BANDED, 10000.0), "random": np.random.default_rng(0).uniform(1, 8, 8),
              "short": np.ones(3), "zero": np.zeros(8), "nan": np.full(8, np.nan)}.get(factors)
    extra = {} if stored is None else {"rope_freqs.weight": stored.astype(np.float32)}
    path = write_gguf(tmp_path / "bad.gguf", {**weights, **extra}, metadata=metadata)
    assert says in refused(path)

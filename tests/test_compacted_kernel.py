"""The compacted-slot and pruned-key kernels (harness/kernels/csrc/cpu_compacted_attention.c,
cpu_pruned_attention.c) against their torch references, at every shape class: head_dim 64, 80 (the
generic path) and 128, GQA groups of 1 and more, fills from 1 to every slot and ragged, fp32 and
int8/int4/fp8 slots. The torch backends of `eviction` and `think` are the oracle: a session through the
kernel gives their logits within fp32 tolerance and keeps the same tokens, budgets of 1 and above the
sequence included (tests/test_exactness.py runs both backends at a budget holding everything).
device=cpu: the kernels are CPU kernels; where the extension cannot be built here, these tests skip."""
from __future__ import annotations

import pytest
import torch

from harness.config import ModelConfig
from strategies.caches import quantization
from strategies.caches.compacted_kernel import COMPACTED_KERNEL, compacted_attention
from strategies.caches.eviction_policies import StepWeights
from strategies.caches.think import ThinKStrategy
from tests.conftest import HEAD128, cpu_model, same_at_thread_counts
from tests.test_eviction import variant

CPU = torch.device("cpu")
_unavailable = COMPACTED_KERNEL.unavailable(CPU, torch.float32)
pytestmark = pytest.mark.skipif(_unavailable is not None, reason=f"the kernels cannot run here: {_unavailable}")

# (head_dim, group): the fixed-width paths at 64 and 128, the generic one at 80 and 16; GQA 1 and more.
HEADS = [(64, 1), (64, 3), (80, 2), (128, 4), (16, 2)]
FORMATS = ["", "int8", "int4", "fp8_e4m3"]
# Sessions: head_dim 64 with one query head per KV head, 80 with two, 128 with four.
D64 = ModelConfig(name="d64", vocab_size=256, d_model=128, n_layers=2, n_heads=2, n_kv_heads=2, ffn_dim=256)
D80 = ModelConfig(name="d80", vocab_size=256, d_model=160, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=256)
SESSION_SHAPES = {"d64": D64, "d80": D80, "head128": HEAD128}


def _slots(format: str, batch: int, n_kv: int, slots: int, dim: int, generator):
    """Random K/V slots as the kernel takes them, and as the torch backend reads them (dequantized)."""
    tables, read = [], []
    for _ in range(2):
        x = torch.randn(batch, n_kv, slots, dim, generator=generator)
        if not format:
            tables.append([x])
            read.append(x)
            continue
        span = 16 if format == "int4" else dim
        codes, scales = quantization.quantize_per_token(x, format, span)
        tables.append([codes, scales])
        read.append(quantization.dequantize_per_token(codes, scales, format, torch.float32))
    return tables, read, (16 if format == "int4" else dim) if format else 0


def _reference(q, k, v, fill):
    """Per pair: softmax(q k^T / sqrt(D)) v over its first fill[b, h] slots -> out [B, n_kv, G, D] and
    the weights averaged over the group [B, n_kv, S] (0 past the fill)."""
    batch, n_kv, group, dim = q.shape
    out, weights = torch.empty_like(q), torch.zeros(batch, n_kv, k.shape[2])
    for b in range(batch):
        for h in range(n_kv):
            n = int(fill[b, h])
            p = (q[b, h] @ k[b, h, :n].T * dim ** -0.5).softmax(-1)  # [G, n]
            out[b, h] = p @ v[b, h, :n]
            weights[b, h, :n] = p.mean(0)
    return out, weights


@pytest.mark.parametrize("format", FORMATS)
@pytest.mark.parametrize("dim,group", HEADS)
@pytest.mark.parametrize("step_weights", list(StepWeights))
def test_attention_over_ragged_fills_equals_the_reference(dim, group, format, step_weights):
    if format == "int4" and dim % 16:
        pytest.skip("int4 groups of 16 channels")
    generator = torch.Generator().manual_seed(dim * 7 + group)
    batch, n_kv, slots = 3, 2, 70  # past one softmax block of 64
    (keys, values), (k, v), span = _slots(format, batch, n_kv, slots, dim, generator)
    fill = torch.tensor([[1, 70], [33, 64], [65, 2]], dtype=torch.int32)  # a budget of 1, every slot, ragged
    q = torch.randn(batch, n_kv, group, dim, generator=generator)
    scores = torch.rand(batch, n_kv, slots, generator=generator)
    before = scores.clone()
    out = compacted_attention(q, keys, values, fill, scores, step_weights, format, span)
    expected, weights = _reference(q, k, v, fill)
    torch.testing.assert_close(out, expected, rtol=2e-5, atol=2e-5)
    filled = torch.arange(slots)[None, None, :] < fill[..., None]  # [B, n_kv, S]
    wanted = {StepWeights.IGNORE: before, StepWeights.ACCUMULATE: before + weights,
              StepWeights.REPLACE: torch.where(filled, weights, before)}[step_weights]
    torch.testing.assert_close(scores, wanted, rtol=1e-5, atol=1e-6)


def test_attention_does_not_depend_on_the_thread_count():
    generator = torch.Generator().manual_seed(5)
    (keys, values), _, _ = _slots("", 4, 3, 257, 64, generator)
    q = torch.randn(4, 3, 3, 64, generator=generator)
    fill = torch.randint(1, 258, (4, 3), generator=generator, dtype=torch.int32)
    scores = torch.zeros(4, 3, 257)

    def call():
        return torch.cat((compacted_attention(q, keys, values, fill, scores, StepWeights.REPLACE).flatten(),
                          scores.flatten()))
    assert same_at_thread_counts(call)


def test_a_fill_past_the_slots_is_refused_before_any_read():
    (keys, values), _, _ = _slots("", 1, 1, 8, 64, torch.Generator().manual_seed(0))
    q = torch.zeros(1, 1, 1, 64)
    for fill in (9, 0):
        with pytest.raises(RuntimeError, match="fill"):
            compacted_attention(q, keys, values, torch.tensor([[fill]], dtype=torch.int32))


def _session_logits(strategy, model, prompt: torch.Tensor, fed: torch.Tensor):
    """Logits of the prefill and of each step fed `fed` [B, steps] (the same tokens whatever the
    backend, so a difference shows as itself), and the caches' tables after."""
    session = strategy.new_session(model, prompt.shape[0], prompt.shape[1] + fed.shape[1])
    logits = [session.prefill(prompt)]
    logits += [session.step(fed[:, j]) for j in range(fed.shape[1])]
    return torch.stack(logits, 1), session.layer_caches


# Every variant, each at budgets of 1 (as far as its paper's parameters allow) and past a softmax block.
EVICTING = [("streaming", {"sinks": 0}, 1), ("streaming", {}, 70), ("h2o", {}, 1), ("h2o", {}, 70),
            ("snapkv", {"window": 1}, 2), ("snapkv", {"window": 8}, 70), ("tova", {}, 1), ("tova", {}, 70),
            ("snapkv_int4", {"window": 8, "group_size": 16}, 70), ("streaming", {"positions": "original"}, 70)]


@pytest.fixture(scope="module", params=list(SESSION_SHAPES))
def shaped(request):
    shape = SESSION_SHAPES[request.param]
    generator = torch.Generator().manual_seed(2)
    prompt = torch.randint(shape.vocab_size, (2, 90), generator=generator)
    fed = torch.randint(shape.vocab_size, (2, 12), generator=generator)
    return cpu_model(shape), prompt, fed


@pytest.mark.parametrize("name,options,budget", EVICTING,
                         ids=[f"{n}{'-' + '-'.join(f'{k}{v}' for k, v in o.items()) if o else ''}-{b}"
                              for n, o, b in EVICTING])
def test_an_evicting_step_through_the_kernel_is_the_torch_backends(shaped, name, options, budget):
    """The same policy through either backend: the same logits within fp32 tolerance at every step, and
    the same tokens kept (positions and fill), slot for slot, every step past the budget evicting."""
    model, prompt, fed = shaped
    runs = [_session_logits(variant(name, backend=backend, budget=budget, **options), model, prompt, fed)
            for backend in ("torch", "c")]
    (torch_logits, torch_caches), (c_logits, c_caches) = runs
    torch.testing.assert_close(c_logits, torch_logits, rtol=1e-4, atol=1e-4)
    for reference, cache in zip(torch_caches, c_caches):
        assert cache.kernel and not reference.kernel
        assert torch.equal(cache.positions, reference.positions) and torch.equal(cache.fill, reference.fill)
        torch.testing.assert_close(cache.scores, reference.scores, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("keep_fraction", [0.6, 1.0])
def test_think_through_the_kernel_is_the_torch_backends(shaped, keep_fraction):
    model, prompt, fed = shaped
    (torch_logits, _), (c_logits, caches) = [
        _session_logits(ThinKStrategy(backend=backend, keep_fraction=keep_fraction, window=8), model, prompt, fed)
        for backend in ("torch", "c")]
    assert caches[0].kernel and caches[0].k.shape[-1] == max(1, round(keep_fraction * model.cfg.resolved_head_dim))
    torch.testing.assert_close(c_logits, torch_logits, rtol=1e-4, atol=1e-4)

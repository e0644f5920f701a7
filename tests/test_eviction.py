"""Evicting caches (strategies/caches/eviction.py), cross-layer sharing (layer_share) and key-channel pruning
(think): what each keeps, the bytes it holds, the positions it attends at, its rewind, its options.
Exactness at a budget that holds everything is in tests/test_exactness.py."""
from __future__ import annotations

import functools

import pytest
import torch

from harness.config import ConfigError
from harness.model.decoder import RotaryTable
from strategies.caches.attention import grouped_attention
from strategies.caches.eviction import EvictionLayerCache, EvictionStrategy
from strategies.caches.eviction_policies import H2OPolicy, SnapKVPolicy, StreamingPolicy, TOVAPolicy
from strategies.caches.layer_share import LayerShareStrategy
from strategies.caches.think import ThinKStrategy
from tests.conftest import GQA4, STRATEGIES, TINY, cpu_model, generate, planned_point

CPU = torch.device("cpu")


@functools.lru_cache(maxsize=None)
def _options(variant: str) -> tuple:
    return tuple(planned_point(f"strategy={variant}", "model=tiny", "model.d_model=128", "ctx=16", "decode_tokens=2")
                 .strategy.strategy_options.items())


def variant_options(variant: str) -> dict:
    """The options conf/strategy/<variant>.yaml composes to (Hydra's defaults list resolved)."""
    return dict(_options(variant))


def variant(name: str, **options) -> EvictionStrategy:
    """The eviction variant conf/strategy/<name>.yaml ships, with `options` set over it."""
    return EvictionStrategy(**{**variant_options(name), **options})


def prompt_of(shape, batch: int, length: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(shape.vocab_size, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def gqa4():
    return cpu_model(GQA4)


def kept_positions(cache: EvictionLayerCache) -> list[set]:
    """Per (sequence, KV head), the positions the cache keeps between steps (its free slot left out)."""
    positions = cache.positions[..., :cache.filled]
    kept = []
    for b in range(positions.shape[0]):
        for h in range(positions.shape[1]):
            row = positions[b, h].tolist()
            if cache.filled > cache.policy.budget:
                row.pop(int(cache.free[b, h]))
            kept.append(set(row))
    return kept


@pytest.mark.parametrize("name, options", [("streaming", {}), ("h2o", {}), ("snapkv", {"window": 4}), ("tova", {}),
                                           ("snapkv_int4", {"window": 4, "group_size": 16})])  # head_dim 16
def test_the_cache_holds_at_most_the_budget_and_its_bytes_shrink(gqa4, name, options):
    budget, length, steps = 12, 40, 10
    strategy = variant(name, budget=budget, **options)
    session = strategy.new_session(gqa4, 2, length + steps)
    token = session.prefill(prompt_of(GQA4, 2, length)).argmax(-1)
    for _ in range(steps):
        for cache in session.layer_caches:
            assert all(len(kept) == budget for kept in kept_positions(cache))
            assert cache.store.read(cache.filled)[0].shape[2] <= budget + 1  # what a step reads
        token = session.step(token).argmax(-1)
    slots, dim, per_layer = budget + 1, GQA4.resolved_head_dim, 2 * GQA4.n_kv_heads  # per sequence and KV head
    if strategy.format:  # int4: half a byte a number, one fp32 scale per 16 channels, for K and V
        stored = 2 * slots * (dim // 2 + 4 * dim // 16)
    else:
        stored = 2 * slots * dim * 4
    bookkeeping = slots * (4 + 4) + 8  # position and score per slot, the free slot's index
    sinks = 4 * dim * 4 if strategy.positions == "in_cache" else 0  # the sinks' keys as first computed
    assert session.kv_cache_bytes == GQA4.n_layers * per_layer * (stored + bookkeeping + sinks)
    full = STRATEGIES["contiguous"]().new_session(gqa4, 2, length + steps).kv_cache_bytes
    assert session.kv_cache_bytes < full * 0.35  # 13 of 50 positions, and the bookkeeping


def test_streaming_keeps_the_sinks_and_the_most_recent_tokens(gqa4):
    strategy = EvictionStrategy(policy="streaming", budget=12, sinks=4)
    session = strategy.new_session(gqa4, 1, 60)
    token = session.prefill(prompt_of(GQA4, 1, 40)).argmax(-1)
    assert kept_positions(session.layer_caches[0])[0] == {0, 1, 2, 3, *range(32, 40)}
    for _ in range(5):
        token = session.step(token).argmax(-1)
    for cache in session.layer_caches:
        assert all(kept == {0, 1, 2, 3, *range(37, 45)} for kept in kept_positions(cache))


def test_in_cache_positions_are_ranks_inside_the_cache():
    """StreamingLLM's scheme: keys before RoPE, rotated at their rank among the kept tokens, the query at
    the rank after them. The cache gets keys roped at their original positions and must attend as that."""
    torch.manual_seed(0)
    batch, n_kv, group, dim, length, budget = 1, 2, 2, 16, 30, 8
    rope = RotaryTable(dim, length, 10000.0, CPU, torch.float32)
    policy = StreamingPolicy(budget, sinks=2)
    cache = EvictionLayerCache(batch, n_kv, length, dim, CPU, torch.float32, policy, None, in_cache_positions=True)
    cache.rope = rope
    raw_q = torch.randn(batch, length, n_kv * group, dim)
    raw_k, v = torch.randn(batch, length, n_kv, dim), torch.randn(batch, length, n_kv, dim)
    prompt = 12
    cache.attend(rope.rotate(raw_q[:, :prompt], 0), rope.rotate(raw_k[:, :prompt], 0), v[:, :prompt], 0)
    for position in range(prompt, length):
        out = cache.attend(rope.rotate(raw_q[:, position:position + 1], position),
                           rope.rotate(raw_k[:, position:position + 1], position), v[:, position:position + 1], position)
        window = list(range(position - (budget - 2), position + 1))  # the step's own token and the recent ones
        kept = [0, 1, *window]
        ranks_k = rope.rotate(raw_k[:, kept], 0)  # rank i for the i-th kept token
        ranks_q = rope.rotate(raw_q[:, position:position + 1], len(kept) - 1)
        expected = grouped_attention(ranks_q, ranks_k.transpose(1, 2), v[:, kept].transpose(1, 2), q_offset=len(kept) - 1)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_h2o_keeps_its_recent_window_and_drops_the_least_accumulated():
    policy = H2OPolicy(budget=4, recent=2)
    positions = torch.tensor([[[0, 1, 2, 3, 4]]], dtype=torch.int32)
    scores = torch.tensor([[[0.9, 0.2, 0.5, 0.0, 0.0]]])  # 3 and 4: the recent window, however low
    assert policy.victims(positions, scores, position=4).item() == 1


def test_snapkv_pools_the_window_scores_and_keeps_the_window():
    policy = SnapKVPolicy(budget=4, window=2, kernel_size=3)
    sums = torch.tensor([[[0.0, 0.0, 1.8, 0.0, 0.0, 0.0, 0.1, 0.0, 0.5, 0.5]]])  # [1, 1, P=10]
    scores = policy.prefill_scores(sums, torch.arange(10), max_len=20)
    # pooled (kernel 3) around the peak at 2 ranks 1, 2, 3 alike; the window (8, 9) always kept
    assert scores[0, 0, 1] == scores[0, 0, 2] == scores[0, 0, 3] == pytest.approx(0.9)
    kept = policy.select(scores, 10)[0, 0].tolist()
    assert kept[2:] == [8, 9] and set(kept[:2]) <= {1, 2, 3}  # two of the three tied at the pooled peak


def test_tova_drops_the_token_the_step_attended_to_least():
    torch.manual_seed(0)
    batch, n_kv, group, dim, budget = 2, 2, 2, 16, 6
    policy = TOVAPolicy(budget)
    cache = EvictionLayerCache(batch, n_kv, 20, dim, CPU, torch.float32, policy, None, in_cache_positions=False)
    q, k, v = torch.randn(batch, 11, n_kv * group, dim), torch.randn(batch, 11, n_kv, dim), torch.randn(batch, 11, n_kv, dim)
    cache.attend(q[:, :10], k[:, :10], v[:, :10], 0)  # the prompt: budget tokens kept by the last query
    last = q[:, 9].view(batch, n_kv, group, dim) @ k[:, :10].transpose(1, 2).transpose(-1, -2) * dim ** -0.5
    chosen = last.softmax(-1).mean(2).topk(budget, dim=-1).indices.sort(-1).values  # [B, n_kv, budget]
    assert torch.equal(cache.positions[..., :budget].long(), chosen)
    cache.attend(q[:, 10:], k[:, 10:], v[:, 10:], 10)  # budget + 1 tokens: one must go
    keys, _ = cache.store.read(cache.filled)
    weights = (q[:, 10].view(batch, n_kv, group, dim) @ keys.transpose(-1, -2) * dim ** -0.5).softmax(-1).mean(2)
    assert torch.equal(cache.free, weights.argmin(-1))


@pytest.mark.parametrize("name, options", [("streaming", {}), ("h2o", {}), ("snapkv", {"window": 4}), ("tova", {})])
def test_warm_up_rewinds_replay_and_leave_the_tokens_alone(gqa4, name, options):
    """The runner's warm-up (the first decode step repeated, rewound after each) and a second pass
    (rewound to the prompt's end) cannot undo an eviction: the session replays, and the tokens stay."""
    strategy = variant(name, budget=10, **options)
    prompt = prompt_of(GQA4, 2, 20)
    expected = generate(strategy, gqa4, prompt, 12)
    session = strategy.new_session(gqa4, 2, 32)
    first = session.prefill(prompt).argmax(-1)
    for _ in range(3):
        session.step(first)
        session.rewind(20)
    tokens = [first]
    for _ in range(12):
        tokens.append(session.step(tokens[-1]).argmax(-1))
    assert torch.equal(torch.stack(tokens, 1), expected)
    session.rewind(25)
    assert session.length == 25 and torch.equal(session.step(tokens[5]).argmax(-1), tokens[6])
    with pytest.raises(ValueError, match="replays from its prompt of 20 tokens"):
        session.rewind(10)


@pytest.mark.parametrize("name, options", [("h2o", {}), ("tova", {}), ("snapkv_int4", {"window": 4, "group_size": 8}),
                                           ("streaming", {"positions": "in_cache"})])
def test_a_rewind_copies_the_prompts_state_back_without_a_second_prefill(gqa4, name, options, monkeypatch):
    """Every table a step touches is as the prompt left it after a rewind to the prompt's end, bitwise,
    and the prompt is not attended again: a warm-up step or timing pass costs a step, not a prefill."""
    strategy = variant(name, budget=10, **options)
    session = strategy.new_session(gqa4, 2, 40)
    first = session.prefill(prompt_of(GQA4, 2, 20)).argmax(-1)
    after_prompt = [cache.snapshot() for cache in session.layer_caches]
    expected = session.step(first)
    for _ in range(6):  # past the budget: slots overwritten, scores and sinks moved
        session.step(first)
    prefills = []
    monkeypatch.setattr(EvictionLayerCache, "_prefill", lambda *args: prefills.append(args))
    session.rewind(20)
    assert not prefills and session.length == 20
    for cache, (filled, tables) in zip(session.layer_caches, after_prompt):
        assert cache.filled == filled and all(torch.equal(a, b) for a, b in zip(cache.snapshot()[1], tables))
    assert torch.equal(session.step(first), expected)


def test_a_random_fill_is_replayed_by_rewind(gqa4):
    strategy = EvictionStrategy(policy="h2o", budget=10)
    session = strategy.new_session(gqa4, 2, 40)
    session.fill_random(30, torch.Generator().manual_seed(7))
    token = torch.tensor([3, 4])
    first = session.step(token)
    session.step(token)
    session.rewind(30)
    assert session.layer_caches[0].filled == 10 and torch.equal(session.step(token), first)


def test_the_accuracy_pass_runs_the_policy_as_decoding_does(gqa4):
    """Teacher forcing feeds the reference's tokens to the strategy's steps: under the budget, each step's
    logits are the ones a decode of those tokens gives."""
    from harness.measure.accuracy import Windows, reference_pass, teacher_forced

    import numpy as np

    strategy = EvictionStrategy(policy="snapkv", budget=12, window=4)
    prompts = prompt_of(GQA4, 2, 24)
    windows = Windows(prompts, None, None, np.ones((2, 6), dtype=bool))
    exact = reference_pass(STRATEGIES["contiguous"](backend="sdpa"), gqa4, windows, chunk=2)
    columns = teacher_forced(strategy, exact, gqa4, windows, chunk=2)
    session = strategy.new_session(gqa4, 2, 30)
    session.prefill(prompts)
    for j in range(5):
        session.step(exact.fed[0][:, j])
    logits = session.step(exact.fed[0][:, 5]).double()
    assert columns["logit_kl_mean"] > 0  # a budget of half the prompt moves the logits
    log_p = exact.logits[0][5].double().log_softmax(-1)
    kl = (log_p.exp() * (log_p - logits.log_softmax(-1))).sum(-1)
    assert columns["logit_kl_max"] >= kl.max().item() - 1e-9


def test_layouts_record_what_each_keeps():
    snapkv = EvictionStrategy(policy="snapkv", budget=64, format="int4", group_size=16).cache_layout(TINY)
    assert (snapkv.token_budget, snapkv.eviction_score, snapkv.value_bits) == (64, "observation_window", 4)
    assert snapkv.scale_bytes_per_token == 2 * 4  # head_dim 16: one fp32 scale each for K and V
    assert EvictionStrategy(policy="tova").cache_layout().eviction_score == "current_attention"
    smollm_depth = TINY.__class__(**{**TINY.__dict__, "n_layers": 30})
    assert LayerShareStrategy().readers(30) == list(range(11, 30, 2))[1:]  # 9 readers: 13, 15, ..., 29
    assert LayerShareStrategy().cache_layout(smollm_depth).layers_stored == 21
    assert ThinKStrategy().cache_layout(TINY).key_channels_kept == 10  # round(0.6 * 16)


def test_layer_share_readers_allocate_nothing_and_read_the_layer_below(gqa4):
    strategy = LayerShareStrategy(layers=[2])
    assert strategy.sources(3) == [0, 1, 1]
    session = strategy.new_session(gqa4, 2, 30)
    full = STRATEGIES["contiguous"]().new_session(gqa4, 2, 30)
    assert session.kv_cache_bytes * 3 == full.kv_cache_bytes * 2
    assert session.layer_caches[2].source is session.layer_caches[1]
    assert torch.equal(generate(LayerShareStrategy(fraction=0.0), gqa4, prompt_of(GQA4, 2, 16), 8),
                       generate(STRATEGIES["no_cache"](), gqa4, prompt_of(GQA4, 2, 16), 8))


def test_think_keeps_the_channels_of_largest_query_key_magnitude(gqa4):
    strategy = ThinKStrategy(keep_fraction=0.5, window=4)
    session = strategy.new_session(gqa4, 1, 30)
    session.prefill(prompt_of(GQA4, 1, 16))
    cache, dim = session.layer_caches[0], GQA4.resolved_head_dim
    assert cache.k.shape[-1] == dim // 2 and cache.v.shape[-1] == dim
    full = STRATEGIES["contiguous"]().new_session(gqa4, 1, 30).kv_cache_bytes
    channels = 1 * GQA4.n_kv_heads * dim // 2 * 8 * GQA4.n_layers  # the kept channels' indices (int64)
    assert session.kv_cache_bytes == full * 3 // 4 + channels  # keys at half width: a quarter of K/V
    assert torch.equal(generate(ThinKStrategy(keep_fraction=1.0), gqa4, prompt_of(GQA4, 2, 16), 8),
                       generate(STRATEGIES["no_cache"](), gqa4, prompt_of(GQA4, 2, 16), 8))


@pytest.mark.parametrize("options,key", [
    ({"budget": 0}, "strategy.budget"),
    ({"policy": "lru"}, "strategy.policy"),
    ({"policy": "snapkv", "budget": 16, "window": 32}, "strategy.window"),
    ({"policy": "streaming", "budget": 4, "sinks": 4}, "strategy.sinks"),
    ({"policy": "h2o", "positions": "in_cache"}, "strategy.positions"),
    ({"format": "int3"}, "strategy.format"),
    ({"policy": "snapkv", "kernel_size": 4}, "strategy.kernel_size"),
    ({"policy": "h2o", "window": 16}, "strategy.window"),
    ({"policy": "tova", "alpha": 0.5}, "strategy.alpha"),
])
def test_bad_eviction_options_name_their_key(options, key):
    with pytest.raises(ConfigError) as refused:
        EvictionStrategy(**options)
    assert str(refused.value).startswith(key)


def test_an_option_the_policy_lacks_is_refused_naming_the_policys_options():
    """Every policy's parameters arrive at their papers' defaults (conf/strategy/eviction.yaml); one set
    for a policy that has no such parameter is refused in one line naming what the policy takes."""
    planned_point("strategy=h2o", "strategy.budget=128", "model=tiny", "ctx=16", "decode_tokens=2")  # still works
    with pytest.raises(ConfigError, match=r"^strategy\.window: policy h2o has no window .*takes: budget, recent$"):
        planned_point("strategy=h2o", "strategy.window=16", "model=tiny", "ctx=16", "decode_tokens=2")
    with pytest.raises(ConfigError, match=r"^strategy\.sinks: policy snapkv has no sinks .*takes: budget, window, "
                                          r"kernel_size$"):
        planned_point("strategy=snapkv", "strategy.sinks=2", "model=tiny", "ctx=16", "decode_tokens=2")


@pytest.mark.parametrize("cls,options,key", [
    (LayerShareStrategy, {"fraction": 0.8}, "strategy.fraction"),
    (LayerShareStrategy, {"layers": [0]}, "strategy.layers"),
    (ThinKStrategy, {"keep_fraction": 0.0}, "strategy.keep_fraction"),
])
def test_bad_sharing_and_pruning_options_name_their_key(cls, options, key):
    with pytest.raises(ConfigError) as refused:
        cls(**options)
    assert str(refused.value).startswith(key)

"""The cache layouts `paged`, `dynamic` and `static_full`: exact, their kernels right, their bytes counted.

Exactness as in tests/test_exactness.py: fp32 greedy tokens equal to the no-cache reference's, at the
three shape classes, under every backend that runs on a CPU; paged with block sizes that do not divide
the sequence lengths, through a shuffled block table. The paged C kernel is checked against gather +
SDPA on head-major pools (the `c` and `torch` layout) whose unused rows are NaN, so a read outside a
sequence's blocks or past its length shows as NaN.
"""
from __future__ import annotations

import math
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from strategies import StrategyOptionError, StrategyUnavailable
from strategies.caches import paged
from strategies.caches.dynamic import DynamicStrategy
from strategies.caches.no_cache import NoCacheStrategy
from strategies.caches.paged import PagedStrategy, gather_blocks, paged_decode_attention
from strategies.caches.static_full import StaticFullStrategy
from tests.conftest import GQA4, HEAD128, LLAMA3_8B_DEPTH1, REPO_ROOT, TINY, cpu_model, generate, same_at_thread_counts

CPU = torch.device("cpu")
C_KERNEL_REASON = paged.PAGED_KERNEL.unavailable(CPU, torch.float32)
needs_c_kernel = pytest.mark.skipif(C_KERNEL_REASON is not None, reason=f"the paged C kernel cannot run: {C_KERNEL_REASON}")

SHAPES = {  # as tests/test_exactness.py: shape, batch, prompt tokens, new tokens
    "tiny": (TINY, 3, 24, 32),
    "gqa4": (GQA4, 2, 40, 24),
    "head128": (HEAD128, 2, 20, 12),
    "llama3_8b_width_depth1": (LLAMA3_8B_DEPTH1, 1, 6, 4),  # ~5 GB of weights: the slow tier
}
SLOW_SHAPES = {"llama3_8b_width_depth1"}
# Every strategy under every backend a CPU runs; block sizes 5 and 16 split the sequences mid-block.
CACHED = [
    (PagedStrategy, {"backend": "c", "block_size": 5}),
    (PagedStrategy, {"backend": "c", "block_size": 16}),
    (PagedStrategy, {"backend": "torch", "block_size": 5}),
    (PagedStrategy, {"backend": "torch", "block_size": 16}),
    (DynamicStrategy, {"backend": "sdpa"}),
    (DynamicStrategy, {"backend": "c"}),
    (StaticFullStrategy, {"backend": "sdpa"}),
    (StaticFullStrategy, {"backend": "c"}),
    (StaticFullStrategy, {"backend": "c", "max_len": 300}),  # a table filled to a fraction
]
CACHED_IDS = [f"{cls.name}-" + "-".join(str(v) for v in options.values()) if options else cls.name
              for cls, options in CACHED]


def runnable(cls, **options):
    """The strategy, or a skip with the reason it cannot run on a CPU in fp32."""
    strategy = cls(**options)
    try:
        strategy.kernel(CPU, torch.float32, TINY)
    except StrategyUnavailable as unavailable:
        pytest.skip(f"{cls.name} {options} cannot run here: {unavailable}")
    return strategy


@pytest.fixture(scope="module", params=[pytest.param(name, marks=pytest.mark.slow) if name in SLOW_SHAPES else name
                                        for name in SHAPES])
def reference(request):
    """A model per shape, built once for the module (the 8B width takes seconds), and its reference tokens."""
    shape, batch, prompt_len, new_tokens = SHAPES[request.param]
    model = cpu_model(shape)
    prompt = torch.randint(shape.vocab_size, (batch, prompt_len), generator=torch.Generator().manual_seed(1))
    yield model, prompt, new_tokens, generate(NoCacheStrategy(), model, prompt, new_tokens)
    del model


@pytest.mark.parametrize("cls,options", CACHED, ids=CACHED_IDS)
def test_generates_the_no_cache_tokens(reference, cls, options):
    model, prompt, new_tokens, expected = reference
    strategy = runnable(cls, **options)
    assert strategy.exact
    assert torch.equal(generate(strategy, model, prompt, new_tokens), expected)


@pytest.fixture(scope="module")
def tiny():
    model = cpu_model(TINY)
    prompt = torch.randint(TINY.vocab_size, (3, 20), generator=torch.Generator().manual_seed(2))
    return model, prompt, generate(NoCacheStrategy(), model, prompt, 16)


@pytest.mark.parametrize("cls,options", CACHED, ids=CACHED_IDS)
def test_warm_up_by_rewinding_leaves_the_tokens_alone(tiny, cls, options):
    """As the runner warms up: repeat the first decode step, rewinding after each, then generate."""
    model, prompt, expected = tiny
    session = runnable(cls, **options).new_session(model, 3, 20 + 16)
    tokens = [session.prefill(prompt).argmax(-1)]
    for _ in range(3):
        session.step(tokens[0])
        session.rewind(20)
    for _ in range(16):
        tokens.append(session.step(tokens[-1]).argmax(-1))
    assert torch.equal(torch.stack(tokens, 1), expected)


# --- the paged C kernel -------------------------------------------------------------------------------

def random_pool(batch, n_kv, head_dim, length, block_size, generator, spare_blocks=5, extra_columns=2):
    """K/V of `length` tokens per sequence [B, n_kv, L, D], and paged copies of them: head-major pools
    [n_blocks, n_kv, block_size, D], as the `c` and `torch` backends keep them, with NaN in every row
    that is not one of a sequence's first `length` positions (rows past the length, spare blocks,
    blocks named by table columns past the ones used) and a shuffled table."""
    used = math.ceil(length / block_size)
    n_blocks = batch * (used + extra_columns) + spare_blocks
    ids = torch.randperm(n_blocks, generator=generator).to(torch.int32)
    table = ids[: batch * (used + extra_columns)].view(batch, used + extra_columns).contiguous()  # [B, max_blocks]
    tensors = []
    for _ in range(2):
        dense = torch.randn(batch, n_kv, length, head_dim, generator=generator)  # [B, n_kv, L, D]
        pool = torch.full((n_blocks, n_kv, block_size, head_dim), float("nan"))  # [n_blocks, n_kv, bs, D]
        for b in range(batch):
            for p in range(length):
                pool[table[b, p // block_size], :, p % block_size] = dense[b, :, p]
        tensors += [dense, pool]
    return (*tensors, table)


def kernel_cases():
    # (batch, n_kv, group, head_dim, length, block_size): groups 1/2/4/8, head_dim 64/128, blocks 1/16/64,
    # lengths short of, equal to and across block and chunk (64) boundaries, one a head_dim tail (24);
    # 3 x 2 and 5 x 1 (sequence, KV head) pairs split into runs of lanes that cross sequences, the last short.
    yield from [(2, 2, 4, 128, 1000, 16), (1, 2, 4, 64, 1, 16), (3, 2, 1, 64, 77, 1), (2, 1, 8, 128, 130, 64),
                (2, 4, 4, 64, 64, 64), (1, 2, 8, 64, 200, 1), (2, 2, 1, 128, 17, 16), (1, 8, 4, 128, 129, 64),
                (2, 2, 4, 24, 50, 16), (1, 1, 8, 128, 81, 16), (3, 2, 2, 64, 100, 16), (5, 1, 4, 64, 90, 16)]


@needs_c_kernel
@pytest.mark.parametrize("batch,n_kv,group,head_dim,length,block_size", list(kernel_cases()))
def test_paged_kernel_matches_gather_and_sdpa(batch, n_kv, group, head_dim, length, block_size):
    generator = torch.Generator().manual_seed(length * 131 + block_size)
    k, k_pool, v, v_pool, table = random_pool(batch, n_kv, head_dim, length, block_size, generator)
    q = torch.randn(batch, n_kv, group, head_dim, generator=generator)  # [B, n_kv, G, D]
    gathered_k, gathered_v = gather_blocks(k_pool, table, length), gather_blocks(v_pool, table, length)
    assert torch.equal(gathered_k, k) and torch.equal(gathered_v, v)  # the gather reads the table right
    expected = F.scaled_dot_product_attention(q, gathered_k, gathered_v)
    got = paged_decode_attention(q, k_pool, v_pool, table, length)
    assert torch.isfinite(got).all()  # no NaN row was read
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@needs_c_kernel
@pytest.mark.parametrize("batch,n_kv,head_dim", [(3, 8, 40), (3, 2, 40), (5, 1, 24), (3, 2, 64), (2, 2, 128)])
def test_paged_kernel_output_does_not_depend_on_the_thread_count(batch, n_kv, head_dim):
    """The generic path (head dims other than 64 and 128) groups (sequence, KV head) pairs into tasks by
    the thread count (here runs of 1 to 4 lanes, some crossing sequences, the last of a split shorter);
    each row's arithmetic stays the same, so the outputs are equal bit for bit; so are the fixed-width
    path's, a task per pair."""
    generator = torch.Generator().manual_seed(3)
    _, k_pool, _, v_pool, table = random_pool(batch, n_kv, head_dim, 150, 16, generator)
    q = torch.randn(batch, n_kv, 4, head_dim, generator=generator)
    assert same_at_thread_counts(lambda: paged_decode_attention(q, k_pool, v_pool, table, 150), (1, 2, 3, 4))


@needs_c_kernel
def test_a_kernel_ignoring_the_table_would_be_caught():
    """Blocks in physical order (an identity table) give other outputs than the shuffled table..."""
    generator = torch.Generator().manual_seed(7)
    batch, n_kv, group, head_dim, length, block_size = 2, 2, 4, 64, 100, 16
    used = math.ceil(length / block_size)
    k_pool = torch.randn(batch * used, n_kv, block_size, head_dim, generator=generator)  # head-major
    v_pool = torch.randn(batch * used, n_kv, block_size, head_dim, generator=generator)
    shuffled = torch.randperm(batch * used, generator=generator).to(torch.int32).view(batch, used)
    identity = torch.arange(batch * used, dtype=torch.int32).view(batch, used)
    q = torch.randn(batch, n_kv, group, head_dim, generator=generator)
    through_table = paged_decode_attention(q, k_pool, v_pool, shuffled, length)
    assert not torch.allclose(through_table, paged_decode_attention(q, k_pool, v_pool, identity, length), atol=1e-3)


@needs_c_kernel
def test_a_session_whose_kernel_ignores_the_table_generates_other_tokens(tiny, monkeypatch):
    """... and the exactness test sees it: the strategy's table is shuffled, so reading blocks in pool
    order changes the tokens."""
    model, prompt, expected = tiny
    real = paged.paged_decode_attention

    def table_ignored(q, k_pool, v_pool, block_table, length):
        identity = torch.arange(block_table.numel(), dtype=torch.int32).view(block_table.shape)
        return real(q, k_pool, v_pool, identity, length)

    strategy = PagedStrategy(backend="c", block_size=4)
    assert torch.equal(generate(strategy, model, prompt, 16), expected)
    monkeypatch.setattr(paged, "paged_decode_attention", table_ignored)
    assert not torch.equal(generate(strategy, model, prompt, 16), expected)


# --- storage accounting -------------------------------------------------------------------------------

TOKEN_BYTES = TINY.n_layers * 2 * TINY.n_kv_heads * TINY.resolved_head_dim * 4  # K and V, every layer, fp32


def step_to(session, prompt, length):
    """Prefill `prompt`, then feed tokens until `length` tokens are cached."""
    token = session.prefill(prompt).argmax(-1)
    while session.length < length:
        token = session.step(token).argmax(-1)


@pytest.mark.parametrize("backend", ["c", "torch"])
def test_paged_counts_the_blocks_handed_out(tiny, backend):
    model, prompt, _ = tiny  # 3 sequences of 20 prompt tokens
    session = runnable(PagedStrategy, backend=backend, block_size=16).new_session(model, 3, 40)
    step_to(session, prompt, 32)
    assert session.kv_cache_bytes == 3 * 2 * 16 * TOKEN_BYTES  # 32 tokens: 2 blocks each
    session.step(torch.zeros(3, dtype=torch.long))  # position 32 opens a third block per sequence
    assert session.kv_cache_bytes == 3 * 3 * 16 * TOKEN_BYTES
    session.rewind(20)
    assert session.kv_cache_bytes == 3 * 3 * 16 * TOKEN_BYTES  # rewound blocks stay with their sequence
    ids = session.blocks.ids[:, :3].flatten()
    assert len(set(ids.tolist())) == 9  # no block handed out twice
    assert not torch.equal(ids.sort().values, ids)  # the pool order is shuffled


@pytest.mark.parametrize("backend", ["c", "torch"])
def test_paged_pools_are_head_major_for_the_cpu_kernels(tiny, backend):
    """[n_blocks, n_kv, block_size, D] for `c` and `torch`, and a decode step writes its K/V into row
    p % block_size of each head of block table[b, p // block_size]."""
    model, prompt, _ = tiny  # 3 sequences of 20 prompt tokens
    session = runnable(PagedStrategy, backend=backend, block_size=16).new_session(model, 3, 40)
    session.prefill(prompt)
    cache = session.layer_caches[0]
    shape = (session.blocks.n_blocks, TINY.n_kv_heads, 16, TINY.resolved_head_dim)
    assert cache.k_pool.shape == cache.v_pool.shape == shape and cache.k_pool.is_contiguous()
    k, v = torch.randn(2, 3, 1, TINY.n_kv_heads, TINY.resolved_head_dim).unbind(0)  # [B, 1, n_kv, D] each
    cache.write(k, v, 20)  # position 20: block column 1, row 4
    block = session.blocks.ids[:, 1].long()
    assert torch.equal(cache.k_pool[block, :, 4], k[:, 0]) and torch.equal(cache.v_pool[block, :, 4], v[:, 0])


def test_paged_pools_are_token_major_for_flash_attn(monkeypatch):
    """flash_attn_with_kvcache's paged mode takes [n_blocks, block_size, n_kv, D] only (the module is
    stubbed: this checks the layout the cache allocates, on a CPU)."""
    monkeypatch.setitem(sys.modules, "flash_attn", types.SimpleNamespace(flash_attn_with_kvcache=None))
    blocks = paged.BlockTable(2, 600, 256, CPU)
    cache = paged.PagedLayerCache(blocks, 2, 8, CPU, torch.float32, "flash_attn")
    assert cache.k_pool.shape == cache.v_pool.shape == (blocks.n_blocks, 256, 2, 8)


def test_paged_fill_random_fills_exactly_the_blocks_of_a_prefill(tiny):
    model, _, _ = tiny
    sessions = [runnable(PagedStrategy, backend=backend, block_size=16).new_session(model, 3, 40)
                for backend in ("c", "torch")]
    for session in sessions:
        session.fill_random(21, torch.Generator().manual_seed(0))
    session = sessions[0]
    assert session.kv_cache_bytes == 3 * 2 * 16 * TOKEN_BYTES  # 21 tokens: 2 blocks each
    filled = torch.zeros(session.blocks.n_blocks, dtype=torch.bool)
    filled[session.blocks.ids[:, :2].flatten().long()] = True
    for cache in session.layer_caches:
        for pool in (cache.k_pool, cache.v_pool):
            nonzero = pool.flatten(1).ne(0).any(1)  # [n_blocks]
            assert torch.equal(nonzero, filled)
    # The same fill serves both kernels: one decode step from it agrees.
    token = torch.arange(3)
    torch.testing.assert_close(sessions[0].step(token), sessions[1].step(token), rtol=1e-4, atol=1e-4)


def test_dynamic_holds_exactly_its_tokens(tiny):
    model, prompt, _ = tiny
    session = DynamicStrategy(backend="sdpa").new_session(model, 3, 40)
    step_to(session, prompt, 27)
    assert session.kv_cache_bytes == 3 * 27 * TOKEN_BYTES
    session.rewind(21)
    assert session.kv_cache_bytes == 3 * 21 * TOKEN_BYTES  # narrowed
    session.step(torch.zeros(3, dtype=torch.long))
    assert session.kv_cache_bytes == 3 * 22 * TOKEN_BYTES
    session.fill_random(30, torch.Generator().manual_seed(0))
    assert session.kv_cache_bytes == 3 * 30 * TOKEN_BYTES and session.length == 30


def test_static_full_holds_max_len(tiny):
    model, prompt, _ = tiny
    session = StaticFullStrategy().new_session(model, 3, 40)
    step_to(session, prompt, 25)
    assert session.kv_cache_bytes == 3 * 40 * TOKEN_BYTES


# --- options, layouts and conf files ------------------------------------------------------------------

@pytest.mark.parametrize("block_size", [0, -16, 2.5, True, "16"])
def test_bad_block_sizes_are_refused(block_size):
    with pytest.raises(StrategyOptionError, match="strategy.block_size"):
        PagedStrategy(block_size=block_size)


def test_flash_attn_refuses_a_block_size_fa2_cannot_page():
    with pytest.raises(StrategyOptionError, match="strategy.block_size.*256"):
        PagedStrategy(backend="flash_attn", block_size=16)
    with pytest.raises(StrategyUnavailable, match="runs on cuda"):  # 256 is accepted, and skipped on a CPU
        PagedStrategy(backend="flash_attn", block_size=256).kernel(CPU, torch.float32)


def test_unknown_backends_are_refused():
    for cls, backend in ((DynamicStrategy, "flash_attn"), (StaticFullStrategy, "flash_attn"), (PagedStrategy, "sdpa")):
        with pytest.raises(StrategyOptionError, match="strategy.backend"):
            cls(backend=backend)


def test_kernel_names_say_what_runs():
    assert PagedStrategy(backend="torch").kernel(CPU, torch.float32).startswith("gather + ")
    assert "flash" not in PagedStrategy(backend="torch").kernel(CPU, torch.float32)
    assert "max_len" in StaticFullStrategy(backend="sdpa").kernel(CPU, torch.float32)
    if C_KERNEL_REASON is None:
        assert StaticFullStrategy().kernel(CPU, torch.float32, TINY).startswith("cpu_decode_attention.c")
        assert "max_len" in StaticFullStrategy().kernel(CPU, torch.float32, TINY)
    if C_KERNEL_REASON is None:
        assert PagedStrategy().kernel(CPU, torch.float32, TINY).startswith("cpu_paged_attention.c")


def test_layouts_declare_what_they_store():
    assert PagedStrategy(block_size=64).cache_layout().block_size == 64
    assert DynamicStrategy().cache_layout().copies_per_step
    assert StaticFullStrategy().cache_layout().reads_max_len


@pytest.mark.parametrize("cls", [PagedStrategy, DynamicStrategy, StaticFullStrategy])
def test_conf_file_builds_the_strategy_with_its_defaults(cls):
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    path = Path(REPO_ROOT, "conf", "strategy", f"{cls.name}.yaml")  # the file stem is the class's name
    conf = OmegaConf.load(path)
    strategy = instantiate(conf)
    assert type(strategy) is cls and strategy.backend == "auto"
    assert {key: conf[key] for key in conf if key not in ("_target_", "backend")} == cls().options()

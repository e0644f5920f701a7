"""Serving is the step measurements' decoding, ragged: through every strategy's serving pool
(strategies.caches.pools), each request's tokens equal those of the same request decoded alone through
the strategy's own batch-1 session (exact strategies: the recompute reference's too), at every shape
class tests/test_exactness.py covers; the pools hold what the strategy's accounting says; the ragged
kernels read each sequence at its own length; and the token check (harness.serve.exactness) finds a
divergence where there is one."""
from __future__ import annotations

import pytest
import torch

from harness.serve.exactness import check_request, check_tokens
from harness.serve.executor import DecoderExecutor, request_prompts
from harness.serve.memory import KVMemory
from harness.serve.records import VirtualClock
from harness.serve.scheduler import serve
from harness.serve.workload import Request, Workload
from tests.conftest import GQA4, HEAD128, LLAMA3_8B_DEPTH1, TINY, cpu_model, generate, planned_point

CPU = torch.device("cpu")
SHAPES = {"tiny": TINY, "gqa4": GQA4, "head128": HEAD128}
# (prompt, output) of requests of different lengths, arriving together: a ragged batch from the start
LENGTHS = [(5, 7), (12, 3), (3, 9), (20, 5), (8, 8), (1, 4)]
# Every strategy that serves, with its kernel: the contiguous arena and the paged blocks on both their
# backends, int8's arena, and the caches served through their own sessions (dynamic, an evicting policy
# at a budget that holds every token: exact, and one that evicts: its own session's tokens).
SERVING = [("contiguous", ()), ("contiguous", ("strategy.backend=sdpa",)), ("paged", ()),
           ("paged", ("strategy.backend=torch",)), ("paged", ("strategy.block_size=4",)), ("int8", ()),
           ("dynamic", ()), ("streaming", ("strategy.budget=64",)), ("h2o", ("strategy.budget=8",))]


@pytest.fixture(scope="module", params=sorted(SHAPES))
def model(request):
    return cpu_model(SHAPES[request.param])


def served(model, name: str, options: tuple, budget_requests: float = 3.0, prefill_chunk=None):
    """The LENGTHS workload served through the strategy's pool; (strategy, pool, executor, outcome)."""
    strategy = planned_point(f"strategy={name}", "model=tiny", *options).strategy.instantiate()
    workload = Workload(tuple(Request(i, 0.0, p, o, o) for i, (p, o) in enumerate(LENGTHS)))
    layout = strategy.sequence_memory(model.cfg, model.dtype)
    budget = int(budget_requests * layout.taken_bytes(32, 32))
    memory = KVMemory(layout, budget)
    pool = strategy.new_pool(model, layout, budget, 40)
    prompts = request_prompts(workload, None, model.cfg.vocab_size, 0, CPU)
    executor = DecoderExecutor(pool, workload, prompts, CPU)
    with torch.inference_mode():
        outcome = serve(workload, memory, executor, VirtualClock(), prefill_chunk=prefill_chunk)
    return strategy, pool, executor, outcome, prompts


def alone(strategy, model, prompts) -> list[list[int]]:
    """Each request decoded alone through the strategy's own batch-1 session."""
    with torch.inference_mode():
        return [generate(strategy, model, prompt[None], output - 1)[0].tolist()
                for prompt, (_, output) in zip(prompts, LENGTHS)]


@pytest.mark.parametrize("name,options", SERVING, ids=[" ".join((n, *o)) for n, o in SERVING])
def test_each_request_gets_the_tokens_it_gets_alone(model, name, options):
    strategy, pool, executor, outcome, prompts = served(model, name, options)
    assert max(i.decodes for i in outcome.iterations) > 2  # the requests were decoded together
    assert executor.outputs == alone(strategy, model, prompts)
    if strategy.exact:
        with torch.inference_mode():
            checks = check_tokens(model, prompts, executor.outputs)
        assert all(check.first_divergence is None for check in checks)


@pytest.mark.slow
@pytest.mark.parametrize("name,options", [("contiguous", ()), ("paged", ())])
def test_at_a_real_models_width_the_ragged_kernels_keep_the_reference_tokens(name, options):
    """The last shape class of tests/test_exactness.py, Llama-3-8B's layer at depth 1 (32 heads over 8 KV
    heads of 128): through the ragged C kernels each request's tokens are its tokens alone and the
    recompute reference's."""
    model = cpu_model(LLAMA3_8B_DEPTH1)
    try:
        strategy, pool, executor, outcome, prompts = served(model, name, options)
        assert max(i.decodes for i in outcome.iterations) > 2 and "ragged (a length per sequence)" in pool.kernel
        assert executor.outputs == alone(strategy, model, prompts)
        with torch.inference_mode():
            assert all(check.first_divergence is None for check in check_tokens(model, prompts, executor.outputs))
    finally:
        del model


@pytest.mark.parametrize("name,options", [s for s in SERVING if s[0] in ("contiguous", "paged", "dynamic")][:4])
def test_preempted_and_chunked_requests_keep_the_reference_tokens_or_say_how_near(model, name, options):
    """Recomputing a preempted request and prefilling in chunks change the order of float sums only: the
    tokens stay the reference's, or the check names the first divergence with a margin at round-off."""
    strategy, pool, executor, outcome, prompts = served(model, name, options, budget_requests=1.2, prefill_chunk=5)
    with torch.inference_mode():
        checks = check_tokens(model, prompts, executor.outputs)
    assert all(len(out) == o for out, (_, o) in zip(executor.outputs, LENGTHS))
    for check in checks:
        assert check.first_divergence is None or check.divergence_margin < 1e-3


@pytest.mark.parametrize("name,options", SERVING, ids=[" ".join((n, *o)) for n, o in SERVING])
def test_a_pool_holds_what_the_strategy_accounts(name, options):
    """Each sequence's tensors in the pool are the bytes its SequenceMemory says it takes."""
    model = cpu_model(TINY)
    strategy = planned_point(f"strategy={name}", "model=tiny", *options).strategy.instantiate()
    layout = strategy.sequence_memory(model.cfg, model.dtype)
    memory = KVMemory(layout, 10 * layout.taken_bytes(40, 40))
    pool = strategy.new_pool(model, layout, memory.budget_bytes, 48)
    generator = torch.Generator().manual_seed(0)
    for seq, (held, reserve) in enumerate(((5, 20), (17, 17), (33, 40))):
        assert memory.admit(seq, held, reserve)
        pool.place(seq, memory.placement(seq), reserve)
        with torch.inference_mode():  # a growing cache holds what it was given
            pool.prefill(seq, torch.randint(TINY.vocab_size, (1, held), generator=generator), 0)
        assert pool.held_bytes(seq) == layout.taken_bytes(held, reserve)


def test_the_ragged_kernels_read_each_sequence_at_its_own_length():
    """One ragged call against the batched kernels run on each sequence alone, bit for bit."""
    from harness.kernels.extension import EXTENSION, ops
    if EXTENSION.unavailable():
        pytest.skip(EXTENSION.unavailable())
    generator = torch.Generator().manual_seed(0)
    n_kv, group, dim, rows = 2, 3, 64, 300
    starts, lengths = torch.tensor([0, 120, 40, 260]), torch.tensor([17, 100, 80, 1])
    q = torch.randn(4, n_kv, group, dim, generator=generator)
    k, v = (torch.randn(n_kv, rows, dim, generator=generator) for _ in range(2))
    ragged = ops().ragged_decode_attention(q, k, v, starts, lengths)
    for b in range(4):
        table = lambda t: t[None, :, starts[b]:starts[b] + lengths[b]]  # [1, n_kv, L, D]
        alone_ = ops().decode_attention(q[b:b + 1], table(k), table(v), int(lengths[b]), int(lengths[b]))
        assert torch.equal(ragged[b], alone_[0])
    pools = [torch.randn(40, n_kv, 16, dim, generator=generator) for _ in range(2)]  # blocks of 16 tokens
    table = torch.randperm(40, generator=generator)[:32].to(torch.int32).view(4, 8)
    ragged = ops().ragged_paged_decode_attention(q, *pools, table, lengths)
    for b in range(4):
        alone_ = ops().paged_decode_attention(q[b:b + 1], *pools, table[b:b + 1], int(lengths[b]))
        assert torch.equal(ragged[b], alone_[0])
    with pytest.raises(RuntimeError, match="run past"):
        ops().ragged_decode_attention(q, k, v, starts + 100, lengths)


def test_the_token_check_names_a_divergence_and_its_margin():
    model = cpu_model(TINY)
    prompt = torch.randint(TINY.vocab_size, (6,), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        tokens = generate(planned_point("strategy=contiguous", "model=tiny").strategy.instantiate(), model,
                          prompt[None], 5)[0].tolist()
        assert check_request(model, prompt, tokens).first_divergence is None
        wrong = tokens[:3] + [(tokens[3] + 1) % TINY.vocab_size] + tokens[4:]
        check = check_request(model, prompt, wrong)
    assert check.first_divergence == 3 and check.divergence_margin > 0
    assert check.reference_agreement <= 5 / 6

"""The serving loop as pure logic (harness.serve.scheduler, .memory, .metrics): a fake executor that
checks what each iteration asks of it, on a virtual clock."""
from __future__ import annotations

import pytest

from harness.serve.memory import ArenaRun, Blocks, KVMemory
from harness.serve.metrics import summary
from harness.serve.records import VirtualClock
from harness.serve.scheduler import Unservable, serve
from harness.serve.workload import Request, Workload
from strategies.serving import ARENA, BLOCKS, SEPARATE, SequenceMemory

TOKEN = 100  # bytes per token of the test layouts
RESERVED = SequenceMemory(TOKEN, ARENA, reserved=True)
PAGED = SequenceMemory(TOKEN, BLOCKS, block_tokens=4)
GROWING = SequenceMemory(TOKEN, SEPARATE)


class FakeExecutor:
    """Keeps what the loop placed, checks every iteration against it, and takes a modelled time:
    1 ms + 0.1 ms per decode + 0.01 ms per prompt token."""

    def __init__(self, memory: KVMemory):
        self.memory = memory
        self.placed: dict[int, object] = {}
        self.iterations = []
        self.placements_seen = []

    def place(self, seq, placement):
        self.placed[seq] = placement
        self.placements_seen.append((seq, placement))
        self._check_disjoint()

    def release(self, seq):
        del self.placed[seq]

    def run(self, iteration):
        for chunk in iteration.prefills:
            assert chunk.seq in self.placed and chunk.tokens > 0
        for seq, position in zip(iteration.decodes, iteration.positions):
            assert seq in self.placed
            placement = self.placed[seq]
            if isinstance(placement, Blocks):  # the block for the token written at `position` is there
                assert position // PAGED.block_tokens < len(placement.ids)
            if isinstance(placement, ArenaRun):
                assert position < placement.tokens
        assert len(set(iteration.decodes)) == len(iteration.decodes)
        self.iterations.append(iteration)
        return 1e-3 + 1e-4 * len(iteration.decodes) + 1e-5 * iteration.prefill_tokens

    def _check_disjoint(self):
        rows, blocks = set(), set()
        for placement in self.placed.values():
            if isinstance(placement, ArenaRun):
                mine = set(range(placement.start, placement.start + placement.tokens))
                assert not rows & mine
                rows |= mine
            elif isinstance(placement, Blocks):
                assert not blocks & set(placement.ids)
                blocks |= set(placement.ids)


def requests(*shapes, arrival=0.0, gap=0.0, max_tokens=None):
    return Workload(tuple(Request(i, arrival + i * gap, p, o, max_tokens or o) for i, (p, o) in enumerate(shapes)))


def run(workload, layout, budget_tokens, **options):
    memory = KVMemory(layout, budget_tokens * TOKEN)
    executor = FakeExecutor(memory)
    outcome = serve(workload, memory, executor, VirtualClock(), **options)
    return outcome, executor, memory


def test_every_request_gets_all_its_tokens_and_memory_comes_back():
    work = requests((5, 3), (7, 1), (2, 6), (9, 4))
    for layout in (RESERVED, PAGED, GROWING):
        outcome, executor, memory = run(work, layout, 200)
        assert [len(r.token_times_s) for r in outcome.requests] == [3, 1, 6, 4]
        assert memory.taken_bytes == 0 and not memory.sequences and not executor.placed
        produced = sum(c.last for i in executor.iterations for c in i.prefills) + sum(len(i.decodes) for i in executor.iterations)
        assert produced == 14


def test_decodes_run_each_sequence_at_its_own_position():
    outcome, executor, _ = run(requests((5, 4), (2, 4)), GROWING, 100)
    first_decode = next(i for i in executor.iterations if i.decodes)
    assert dict(zip(first_decode.decodes, first_decode.positions)) == {0: 5, 1: 2}


def test_reservation_admits_fewer_than_paging_in_the_same_budget():
    """Prompt 8, output 8 but max_tokens 32: a reservation takes 40 tokens each, paging 8 to 16."""
    work = requests(*[(8, 8)] * 8, max_tokens=32)
    reserved, _, _ = run(work, RESERVED, 80)
    paged, _, _ = run(work, PAGED, 80)
    peak = lambda outcome: max(i.running for i in outcome.iterations)
    assert peak(reserved) == 2
    assert peak(paged) >= 4
    assert summary(reserved)["kv_utilization"] < summary(paged)["kv_utilization"]


def test_paged_growth_preempts_the_newest_and_recomputes_it():
    """Four sequences whose prompts fit but whose outputs do not: the newest is preempted, later
    prefilled again (prompt + its output so far), and every request still gets its tokens."""
    work = requests(*[(4, 12)] * 4)
    outcome, executor, _ = run(work, PAGED, 32)
    assert outcome.preemptions > 0
    assert [len(r.token_times_s) for r in outcome.requests] == [12] * 4
    preempted = [r for r in outcome.requests if r.preemptions]
    assert outcome.requests[0].preemptions == 0  # the oldest is never the newest
    recomputed = sum(i.prefill_tokens for i in executor.iterations) - sum(r.request.prompt_len for r in outcome.requests)
    assert preempted and recomputed > 0
    recompute = [c for i in executor.iterations for c in i.prefills if c.tokens > 4]  # prompt + output so far
    assert recompute and all(c.last for c in recompute)


def test_a_reservation_never_preempts():
    outcome, _, _ = run(requests(*[(4, 12)] * 4), RESERVED, 32)
    assert outcome.preemptions == 0
    assert max(i.running for i in outcome.iterations) == 2


def test_chunked_prefill_bounds_prompt_tokens_per_iteration():
    outcome, executor, _ = run(requests((10, 2), (7, 2)), GROWING, 100, prefill_chunk=4)
    assert all(i.prefill_tokens <= 4 for i in executor.iterations)
    chunks = [(c.seq, c.start, c.tokens, c.last) for i in executor.iterations for c in i.prefills]
    assert [c for c in chunks if c[0] == 0] == [(0, 0, 4, False), (0, 4, 4, False), (0, 8, 2, True)]
    first_token = outcome.requests[0].token_times_s[0]
    last_chunk_end = [i for i in outcome.iterations if i.prefill_tokens][2].end_s
    assert first_token == last_chunk_end


def test_arrivals_are_honoured_and_idle_time_passes():
    outcome, executor, _ = run(requests((3, 2), (3, 2), gap=5.0), GROWING, 100)
    second = outcome.requests[1]
    assert second.admitted_s >= 5.0 and second.queue_wait_s == pytest.approx(0.0)
    assert outcome.requests[0].token_times_s[-1] < 5.0


def test_fcfs_admission_never_overtakes():
    """A head that does not fit blocks the small requests behind it (no overtaking)."""
    work = requests((30, 2), (60, 2), (2, 2))
    outcome, _, _ = run(work, GROWING, 70)
    assert outcome.requests[2].admitted_s >= outcome.requests[1].admitted_s


def test_an_arena_fragments():
    """Free rows in total, no run long enough: the reservation waits for a neighbour to finish."""
    memory = KVMemory(RESERVED, 100 * TOKEN)
    assert memory.admit(0, 30, 30) and memory.admit(1, 40, 40) and memory.admit(2, 30, 30)
    memory.free(0)
    memory.free(2)
    assert memory.budget_bytes - memory.taken_bytes == 60 * TOKEN
    assert not memory.admit(3, 50, 50)  # 60 rows free, in two runs of 30
    memory.free(1)
    assert memory.admit(3, 50, 50) and memory.placement(3) == ArenaRun(0, 50)


def test_closed_loop_keeps_its_concurrency():
    work = Workload(tuple(Request(i, None, 4, 3, 3) for i in range(7)), concurrency=2)
    outcome, executor, _ = run(work, GROWING, 100)
    assert all(len(r.token_times_s) == 3 for r in outcome.requests)
    assert max(i.running for i in outcome.iterations) == 2
    sent = sorted(r.arrival_s for r in outcome.requests)
    assert sent[:2] == [0.0, 0.0] and sent[2] > 0


def test_max_batch_caps_the_running_sequences():
    outcome, _, _ = run(requests(*[(2, 5)] * 6), GROWING, 1000, max_batch=3)
    assert max(i.running for i in outcome.iterations) == 3


def test_a_request_the_budget_cannot_hold_alone_is_unservable():
    with pytest.raises(Unservable, match="request 0"):
        run(requests((50, 2)), GROWING, 40)
    with pytest.raises(Unservable):  # fits at admission, cannot grow even alone
        run(requests((30, 20)), PAGED, 32)


def test_metrics_by_hand():
    """One request, prompt 2, output 3, alone: TTFT is the prefill iteration, ITL the decodes'."""
    outcome, executor, _ = run(requests((2, 3)), GROWING, 10)
    prefill = 1e-3 + 1e-5 * 2
    decode = 1e-3 + 1e-4
    columns = summary(outcome, slo_ttft_s=prefill * 1.01, slo_tpot_s=decode * 0.99)
    assert columns["ttft_mean_s"] == pytest.approx(prefill)
    assert columns["itl_p50_s"] == pytest.approx(decode)
    assert columns["tpot_mean_s"] == pytest.approx(decode)
    assert columns["e2e_mean_s"] == pytest.approx(prefill + 2 * decode)
    assert columns["output_throughput"] == pytest.approx(3 / (prefill + 2 * decode))
    assert columns["normalized_latency_mean_s"] == pytest.approx((prefill + 2 * decode) / 3)
    assert columns["slo_attainment"] == 0.0  # its TPOT misses
    assert summary(outcome)["goodput"] is None
    assert columns["kv_holding_bytes_peak"] <= columns["kv_taken_bytes_peak"]

"""Measure a group: points of one shape (model, dtype, device, batch, ctx, ...) that differ only in
strategy, matmul kernel or compile mode, timed together in one process so that they compare.

On a shared machine the bandwidth a step gets moves by tens of percent within minutes, so two points
measured one after the other differ by the machine as much as by their strategies. A group removes
that: one model per linear kernel, every member's session alive at once (harness.measure.member), and
rounds (harness.measure.rounds, the harness's one timing engine) in which every member takes one timed
step at the round's decode position, in an order that rotates and reverses from round to round (no
member always runs first, or always after the same other one). A pass over the `decode_tokens`
positions is repeated (rewound, the same tokens) while another fits timing.rounds_budget_s, up to
timing.max_passes. The rounds also time the calibration's matrix-vector read
(harness.measure.roofs.GemvRead), so every row carries the bandwidth the machine gave in its own
window beside the calibrated best-of roof: in every round while it takes at most PROBE_SHARE of the
members' time, and in the first round of every pass.

After the rounds each member's step time gets its bootstrap interval, and each member other than the
group's reference its round-by-round ratio to the reference with an interval
(harness.measure.intervals, through harness.measure.rounds.Rounds). The reference is chosen by what members
declare, by the one rule (harness.config.layout.could_be_reference): an exact cached strategy that ran, the
plain contiguous layout first (reference_index).

Runs inside one process of its own (harness.run.isolation). Returns one measured dict per member, in
the group's order; `harness.run.row` makes each a row.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from harness.config import Point
from harness.measure.contention import gpu_state
from harness.measure.compiled import graphs_compiled
from harness.measure.device import device_name
from harness.measure.intervals import METHOD as INTERVAL_METHOD
from harness.measure.member import PEAK_METHOD, Member
from harness.measure.memory import PeakTracker, anon_hugepages_bytes, use_hugepages
from harness.measure.accuracy import ReferencePasses
from harness.measure.agreement import NOT_CHECKED, checks_agreement, judge_kl
from harness.measure.decoding import PREFILL, accuracy, accuracy_failed, tokens_digest
from harness.measure.roofs import PROBE_BYTES, GemvRead, gemv_kernels
from harness.measure.rounds import Rounds, RoundsOptions, time_rounds
from harness.measure.threads import fitted_threads
from harness.measure.timing import StepTimer
from harness.model import build_model
from harness.model.cpu_linear import KERNELS as MATMUL_KERNELS

# The read probe's time in a group's rounds, at most, as a share of its members' (past each pass's first
# round): a 256 MiB read is ~9 ms here, so it runs in every round beside a SmolLM2-sized step, while
# beside a tiny test model's sub-millisecond steps, when it ran in every round, it took ~85% of the rounds.
PROBE_SHARE = 0.25


@dataclass(frozen=True)
class GroupRequest:
    """What a group's process measures."""

    group_id: str  # names the group in every member's row
    members: tuple[Point, ...]  # same shape, device, dtype, batch, ctx, timing, threads, page size
    roof_kernel: str | None = None  # the calibration's best matrix-vector read (GemvRead.kernel); None: the fastest that runs


def reference_index(points, ran=None) -> int | None:
    """The group's reference, the one rule for it (the runner times it again beside re-measured members,
    and the rows record it as group_reference): among the exact cached members that ran (`ran`, one
    bool per point; None: as if all did), one that could be a reference (harness.config.layout.could_be_reference) first,
    then the lexically first strategy name, so the choice never depends on the order the sweep listed
    them in; None when none ran."""
    live = [i for i, point in enumerate(points) if (ran is None or ran[i]) and point.strategy.exact
            and point.strategy.caches_kv]
    if not live:
        return None
    return min(live, key=lambda i: (not points[i].strategy.could_be_reference, points[i].strategy.name, i))


def measure_group(request: GroupRequest) -> list[dict]:
    first = request.members[0]
    if first.hugepages:  # first: torch's allocator reads it at this process's first allocation
        use_hugepages()
    # Inference mode: no step pays for autograd's version counters and view tracking.
    with torch.inference_mode():
        return _GroupRun(request).measure()


PRIME_CTX = 64  # prompt tokens of the discarded set-up that primes a group's process (_GroupRun.prime)


class _GroupRun:
    def __init__(self, request: GroupRequest):
        self.request = request
        first = request.members[0]
        self.device, self.dtype = torch.device(first.device), getattr(torch, first.dtype)
        torch.set_num_threads(first.threads)
        self.timer = StepTimer(self.device, cold_cache=first.timing.cold_cache)
        self.threads = fitted_threads(first)  # one count for the process: the members on torch's threads share it
        self.members = [Member(point, self.threads) for point in request.members]
        self.models: dict[str, tuple[object, int]] = {}  # matmul -> (model, its resident bytes)

    def model_for(self, point: Point):
        """One model per linear kernel, built once (same seed: the same weights) and shared."""
        if point.matmul not in self.models:
            tracker = PeakTracker(self.device)
            tracker.start()
            model = build_model(point.model, self.device, self.dtype, point.seed, point.matmul, batch_hint=point.batch)
            self.models[point.matmul] = (model, max(tracker.held_bytes(), 0))  # freed memory it reused is not new
        return self.models[point.matmul]

    def measure(self) -> list[dict]:
        process = PeakTracker(self.device)
        process.start()
        self.prime()
        references = ReferencePasses()  # the exact reference's passes, run once for every member
        ready = 0  # members set up so far: their sessions stay alive through the rounds
        checked = any(checks_agreement(member.point) for member in self.members)  # else no first step is kept
        for member in self.set_up_order():
            try:
                member.set_up(*self.model_for(member.point), self.timer, beside=ready, references=references,
                              share_first_step=checked)
            except Exception as error:  # noqa: BLE001 - a member's failure is its row, not the group's
                member.fail(error)
            ready += member.live
        live = any(m.live for m in self.members)
        rounds = self.run_rounds(self.read_probe()) if live else None  # nothing to time when none set up
        reference = reference_index([m.point for m in self.members], [m.live for m in self.members])
        outcomes = [self.outcome(i, member, rounds, reference, process.baseline_bytes)
                    for i, member in enumerate(self.members)]
        for member, outcome in zip(self.members, outcomes):  # every session freed first: one at a time
            if member.live:
                try:
                    outcome.update(accuracy(member.point, member.strategy, self.model_for(member.point)[0], references))
                except Exception as error:  # noqa: BLE001 - one member's pass failing is its row, not the group's
                    outcome.update(accuracy_failed(error))
                outcome.update(judge_kl(outcome, member.strategy))
        return outcomes

    def set_up_order(self) -> list[Member]:
        """The members, one that could be the reference first: its first step then serves the agreement
        checks of the members after it (harness.measure.agreement.offer_first_step), no prefill of their own."""
        return sorted(self.members, key=lambda member: not member.point.strategy.could_be_reference)

    def prime(self) -> None:
        """Set up the first member that runs here once, over a prompt of at most PRIME_CTX tokens, and
        discard it: what a process pays once (thread pools, kernel libraries, the prompt's and the step's
        first calls) then lands in no member's timings or peak, not in the first one's. Not over the
        point's own prompt: at batch 4 and ctx 4096 that prefill cost 45 s on 2 cores, for nothing kept."""
        for member in self.set_up_order():
            trial = Member(dataclasses.replace(member.point, ctx=min(member.point.ctx, PRIME_CTX)))
            try:
                trial.set_up(*self.model_for(member.point), self.timer)
            except Exception:  # noqa: BLE001 - the member's own set-up meets the same error and records it
                continue
            if trial.live:
                return

    def read_probe(self) -> GemvRead:
        first = self.request.members[0]
        kernels = gemv_kernels(first.device, first.dtype, any(point.matmul == "c" for point in self.request.members))
        kernel = self.request.roof_kernel if self.request.roof_kernel in kernels else kernels[-1]
        return GemvRead(kernel, PROBE_BYTES[first.device], self.device, self.dtype)

    def run_rounds(self, probe: GemvRead) -> dict:
        """Rounds over the decode positions: in each, every live member one timed step at the round's
        position, and the read probe once. A pass is decode_tokens rounds; passes repeat while one more
        fits timing.rounds_budget_s, up to timing.max_passes. A member whose step raises leaves them."""
        first = self.request.members[0]
        options = RoundsOptions(rounds=first.decode_tokens, max_passes=first.timing.max_passes,
                                budget_s=first.timing.rounds_budget_s, warmup=0, keep_going=True, roof_share=PROBE_SHARE)
        graphs_before = graphs_compiled()
        steps = {str(i): member.step() for i, member in enumerate(self.members) if member.live}  # named by index
        try:
            rounds = time_rounds(steps, options, probe, self.timer)
        finally:
            if self.threads is not None:
                self.threads.restore()  # the accuracy passes after the rounds run at the threads asked
        recompiles = graphs_compiled() - graphs_before  # before any other code can compile
        gpu = gpu_state(self.device.index or 0) if self.device.type == "cuda" else {}
        hugepages = anon_hugepages_bytes()  # what the pages were, whatever was asked, while every table is held
        for name, error in rounds.failures.items():
            self.members[int(name)].fail(error)
        return {"rounds": rounds, "recompiles": recompiles, "gpu": gpu, "anon_hugepages_bytes": hugepages}

    def outcome(self, index: int, member: Member, rounds: dict | None, reference: int | None,
                process_baseline: int) -> dict:
        """A member's measured dict (its session freed), the accuracy columns still to come."""
        group = {"group_id": self.request.group_id, "group_size": len(self.members),
                 "device_name": device_name(self.device)}
        own = {**NOT_CHECKED, **member.columns}  # what the strategy reports of itself, and its agreement
        if not member.live:
            return {**member.outcome, **group, **own}
        return {**self._timed_columns(index, member, rounds), **group, **own,
                **self._ratio_columns(index, rounds, reference),
                **self._memory_columns(member, process_baseline),
                "tokens_digest": tokens_digest(member.tokens()),
                "tokens": member.tokens().cpu().tolist()}  # for tests and callers; not stored in the row

    def _timed_columns(self, index: int, member: Member, rounds: dict) -> dict:
        timed: Rounds = rounds["rounds"]
        point, stats = member.point, timed.stats(str(index))
        prefill = member.prefill.stats(PREFILL) if member.prefill else None  # the prompt's own rounds
        prefill_interval = member.prefill.median(PREFILL) if member.prefill else None
        step, roof = timed.median(str(index)), timed.roof
        return {
            "status": "ok", "reason": "", "kernel": member.kernel,
            "matmul_kernel": MATMUL_KERNELS[point.matmul],
            "compile_mode": member.compiled.call if member.compiled else "eager",
            "compile_s": member.compiled.compile_s if member.compiled else None,
            "compile_recompiles": rounds["recompiles"] if member.compiled else None,
            "prefill_s": prefill.p50 if prefill else None,
            "prefill_p10_s": prefill.p10 if prefill else None,
            "prefill_p90_s": prefill.p90 if prefill else None,
            "prefill_ci_low_s": prefill_interval.low if prefill else None,
            "prefill_ci_high_s": prefill_interval.high if prefill else None,
            "prefill_repeats": prefill.count if prefill else None,
            "decode_step_s": stats.p50, "decode_step_p10_s": stats.p10, "decode_step_p90_s": stats.p90,
            "decode_step_ci_low_s": step.low, "decode_step_ci_high_s": step.high,
            "decode_steps_timed": stats.count, "decode_step_times_s": list(timed.seconds[str(index)]),
            "decode_steps_fewer_threads": member.steps_fewer_threads if member.follows_torch_threads else None,
            "rounds": timed.count, "interval_method": INTERVAL_METHOD,
            "warmup_steps": member.warmup_steps,
            "timing_method": self.timer.method + (", CUDA graph replay" if point.timing.cuda_graphs else "")
                             + (f", interleaved with {len(self.members) - 1} other(s) in rotating order"
                                if len(self.members) > 1 else ""),
            "tokens_per_s": point.batch / stats.p50,
            "contention": timed.contention, **rounds["gpu"],
            "roof_bandwidth_in_rounds_Bps": roof.median if roof else None,
            "roof_in_rounds_kernel": timed.roof_kernel, "anon_hugepages_bytes": rounds["anon_hugepages_bytes"],
        }

    def _ratio_columns(self, index: int, rounds: dict, reference: int | None) -> dict:
        columns = {"group_reference": None, "group_reference_key": None, "ratio_to_reference": None,
                   "ratio_ci_low": None, "ratio_ci_high": None}
        if reference is None:
            return columns
        partner = self.members[reference].point
        columns.update(group_reference=partner.strategy.variant, group_reference_key=partner.key)
        if reference != index:
            ratio = rounds["rounds"].ratio(str(index), str(reference))
            columns.update(ratio_to_reference=ratio.median, ratio_ci_low=ratio.low, ratio_ci_high=ratio.high)
        return columns

    def _memory_columns(self, member: Member, process_baseline: int) -> dict:
        memory = dict(member.memory)
        if self.device.type == "cpu":
            memory["process_baseline_bytes"] = process_baseline
        return {**memory, **member.release(), "peak_memory_method": PEAK_METHOD[self.device.type]}


def measure_point(point: Point) -> dict:
    """One point measured alone: a group of one (its rounds still time the read probe beside its steps)."""
    return measure_group(GroupRequest(group_id=point.key, members=(point,)))[0]

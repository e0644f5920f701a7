"""The serving loop: iteration-level scheduling of a workload within a KV budget. Pure logic: it keeps
time by a clock, places memory through harness.serve.memory.KVMemory, and hands each iteration to an
executor (harness.serve.records says what an iteration asks and gets back), so the same loop drives
the decoder (harness.serve.executor) or a step-time model.

Each iteration, as vLLM's scheduler does it (first come, first served; Orca's iteration level):
1. Requests whose arrival time has come join the waiting queue (a closed loop sends the next request
   when one finishes).
2. Every running sequence that is decoding needs room for one more token: its memory grows
   (KVMemory.grow: a paged sequence takes a block when its last one is full; a reservation never needs
   to). Where the budget cannot give it, the newest running sequence is preempted by recompute
   (vLLM's default): its memory is freed at once, it goes back to the head of the queue, and when it is
   admitted again its prompt and its output so far are prefilled again. A sequence may preempt itself.
3. Unless this iteration preempted, waiting requests are admitted in order while the budget holds
   what the head of the queue needs (its prompt and, for a reservation, prompt + max_tokens) and fewer
   than `max_batch` sequences run; the first that does not fit stops admission (no overtaking).
4. Sequences still prefilling get their next prompt chunk, oldest first, at most `prefill_chunk` prompt
   tokens in all this iteration (None: whole prompts).
5. The executor runs the iteration: the chunks, and one decode step for every decoding sequence, each
   at its own length. Every finished prompt and every decode step yields a token at the iteration's
   end; a request with all its output tokens is finished and its memory freed at once.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Optional

from harness.serve.memory import KVMemory
from harness.serve.records import (Executor, Iteration, IterationRecord, PrefillChunk, RequestRecord,
                                   ServingOutcome)
from harness.serve.workload import Request, Workload


class Unservable(RuntimeError):
    """A request the budget cannot hold even alone (the plan refuses such a workload first)."""


@dataclass(eq=False)  # one object per request: compared by identity (field equality made `in` quadratic and slow)
class _Sequence:
    """A request's state in the loop."""

    record: RequestRecord
    known: int  # tokens known: the prompt and the output so far
    computed: int = 0  # tokens whose K/V the cache holds
    admitted: int = -1  # admission stamp: the highest is the newest running sequence
    prefilling: bool = True  # tokens known but not computed remain before its next decode step

    @property
    def request(self) -> Request:
        return self.record.request

    @property
    def index(self) -> int:
        return self.record.request.index


def serve(workload: Workload, memory: KVMemory, executor: Executor, clock, prefill_chunk: Optional[int] = None,
          max_batch: int = 256) -> ServingOutcome:
    """Run `workload` to its end (the module docstring); every request is served."""
    return _Loop(workload, memory, executor, clock, prefill_chunk, max_batch).run()


class _Loop:
    def __init__(self, workload, memory, executor, clock, prefill_chunk, max_batch):
        self.memory, self.executor, self.clock = memory, executor, clock
        self.prefill_chunk, self.max_batch = prefill_chunk, max_batch
        self.sequences = [_Sequence(RequestRecord(r, r.arrival_s), r.prompt_len) for r in workload.requests]
        order = sorted(self.sequences, key=lambda s: (s.request.arrival_s or 0.0, s.index))
        self.pending: deque[_Sequence] = deque(order)  # not yet arrived, by arrival
        if workload.closed:  # the first `concurrency` are sent at once; each finish sends the next
            for sequence in list(self.pending)[: workload.concurrency]:
                sequence.record.arrival_s = 0.0
        self.closed = workload.closed
        self.waiting: deque[_Sequence] = deque()  # arrived, not running, first come first
        self.running: list[_Sequence] = []  # holding memory, oldest admission first
        self.iterations: list[IterationRecord] = []
        self.admissions = self.preemptions = 0

    def run(self) -> ServingOutcome:
        while True:
            self._arrive(self.clock.now())
            if not self.running and not self.waiting:
                if not self.pending or self.pending[0].record.arrival_s is None:
                    break
                self.clock.idle_until(self.pending[0].record.arrival_s)
                continue
            start = self.clock.now()
            decodes, preempted = self._grow_decodes()
            if not preempted:
                self._admit(start)
            prefills = self._chunks()
            if not prefills and not decodes:
                head = self.waiting[0].request
                raise Unservable(f"request {head.index} (prompt {head.prompt_len}, max_tokens {head.max_tokens}) does "
                                 f"not fit the KV budget of {self.memory.budget_bytes:,} bytes even alone")
            iteration = Iteration(tuple(prefills), tuple(s.index for s in decodes), tuple(s.computed for s in decodes))
            self.clock.ran(self.executor.run(iteration))
            self._advance(iteration, prefills, decodes, start, self.clock.now())
        records = tuple(sequence.record for sequence in self.sequences)
        return ServingOutcome(records, tuple(self.iterations), self.preemptions)

    def _arrive(self, now: float) -> None:
        while self.pending and self.pending[0].record.arrival_s is not None and self.pending[0].record.arrival_s <= now:
            self.waiting.append(self.pending.popleft())

    def _grow_decodes(self) -> tuple[list[_Sequence], bool]:
        """The decoding sequences that got room for their next token, oldest first; whether any
        sequence was preempted to make room."""
        decodes, preempted = [], False
        for sequence in list(self.running):
            if sequence.prefilling or sequence not in self.running:
                continue
            before = self.memory.placement(sequence.index)
            while not self.memory.grow(sequence.index, sequence.computed + 1):
                victim = self.running[-1]
                self._preempt(victim)
                preempted = True
                if victim is sequence:
                    break
            else:
                if self.memory.placement(sequence.index) is not before:  # a new block
                    self.executor.place(sequence.index, self.memory.placement(sequence.index))
                decodes.append(sequence)
        return decodes, preempted

    def _preempt(self, sequence: _Sequence) -> None:
        self.memory.free(sequence.index)
        self.executor.release(sequence.index)
        self.running.remove(sequence)
        sequence.computed, sequence.prefilling = 0, True
        sequence.record.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(sequence)

    def _admit(self, now: float) -> None:
        while self.waiting and len(self.running) < self.max_batch:
            head = self.waiting[0]
            reserve = max(head.known, head.request.reserve)
            if not self.memory.admit(head.index, head.known, reserve):
                return
            self.waiting.popleft()
            head.admitted, self.admissions = self.admissions, self.admissions + 1
            if head.record.admitted_s is None:
                head.record.admitted_s = now
            self.executor.place(head.index, self.memory.placement(head.index))
            self.running.append(head)

    def _chunks(self) -> list[PrefillChunk]:
        left = self.prefill_chunk if self.prefill_chunk is not None else float("inf")
        chunks = []
        for sequence in self.running:
            if not sequence.prefilling or left <= 0:
                continue
            tokens = int(min(sequence.known - sequence.computed, left))
            chunks.append(PrefillChunk(sequence.index, sequence.computed, tokens,
                                       last=sequence.computed + tokens == sequence.known))
            left -= tokens
        return chunks

    def _advance(self, iteration: Iteration, prefills: list[PrefillChunk], decodes: list[_Sequence],
                 start: float, end: float) -> None:
        by_index = {s.index: s for s in self.running}
        produced = []
        for chunk in prefills:
            sequence = by_index[chunk.seq]
            sequence.computed += chunk.tokens
            if chunk.last:
                sequence.prefilling = False
                produced.append(sequence)
        for sequence in decodes:
            sequence.computed += 1
            produced.append(sequence)
        for sequence in produced:
            sequence.known += 1
            sequence.record.token_times_s.append(end)
        # The memory the iteration computed with, before its finished sequences give theirs back.
        self.iterations.append(IterationRecord(start, end, iteration.prefill_tokens, len(decodes),
                                               len(decodes) + len(prefills), len(self.waiting),
                                               self.memory.taken_bytes, self.memory.holding_bytes))
        for sequence in produced:
            if sequence.record.finished:
                self._finish(sequence, end)

    def _finish(self, sequence: _Sequence, end: float) -> None:
        self.memory.free(sequence.index)
        self.executor.release(sequence.index)
        self.running.remove(sequence)
        if self.closed:
            for waiting in self.pending:  # the next unsent request goes out now
                if waiting.record.arrival_s is None:
                    waiting.record.arrival_s = end
                    break

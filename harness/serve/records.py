"""The types a serving run is made of: what an iteration asks its executor, what the run records per
request and per iteration, and the clocks it keeps time by. Pure: no torch.

The executor seam (harness.serve.scheduler drives it; harness.serve.executor runs our decoder, a
simulation returns a modelled time instead):
- `place(seq, placement)`: the sequence `seq` (a request's index) now holds this memory, as the
  allocator placed it (harness.serve.memory: an arena run, a block list, or None for tensors of its
  own); called at admission, at readmission after a preemption, and whenever it takes a new block.
- `release(seq)`: its memory is freed (it finished, or was preempted: its tokens are not forgotten,
  a readmitted sequence prefills its prompt and its output so far again).
- `run(iteration) -> seconds`: compute one iteration (below) and say how long it took.
An `Iteration` holds the prompt chunks to prefill (each sequence's tokens `start .. start + tokens - 1`
of its prompt followed by its output so far; a chunk marked `last` ends what the sequence has to
prefill, and its last position's logits give the sequence's next token) and the sequences decoding one
token each, every one at its own position. Every `last` chunk and every decode produces one token, at
the end of the iteration: the scheduler counts them, the executor keeps their ids.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional, Protocol

from harness.serve.memory import Placement
from harness.serve.workload import Request


@dataclass(frozen=True)
class PrefillChunk:
    """Prompt tokens of one sequence computed in one iteration."""

    seq: int  # the request's index
    start: int  # first position of the chunk in the sequence's tokens (prompt, then its output so far)
    tokens: int  # positions start .. start + tokens - 1
    last: bool  # the chunk ends what the sequence has to prefill: it produces the sequence's next token


@dataclass(frozen=True)
class Iteration:
    """What one iteration computes: prompt chunks, and one decode step for each decoding sequence."""

    prefills: tuple[PrefillChunk, ...]
    decodes: tuple[int, ...]  # sequences decoding one token each
    positions: tuple[int, ...]  # each decode's position: the tokens its cache holds before the step

    @property
    def prefill_tokens(self) -> int:
        return sum(chunk.tokens for chunk in self.prefills)


class Executor(Protocol):
    """What computes the iterations (the module docstring)."""

    def place(self, seq: int, placement: Placement) -> None: ...

    def release(self, seq: int) -> None: ...

    def run(self, iteration: Iteration) -> float: ...


@dataclass
class RequestRecord:
    """One request's life in a serving run: when it came, was first scheduled, and got each token."""

    request: Request
    arrival_s: Optional[float]  # the workload's, or for a closed loop when it was sent
    admitted_s: Optional[float] = None  # the start of the iteration that first scheduled it
    token_times_s: list[float] = field(default_factory=list)  # the end of the iteration that produced each output token
    preemptions: int = 0  # times its memory was taken back and its tokens recomputed later

    @property
    def finished(self) -> bool:
        return len(self.token_times_s) == self.request.output_len

    @property
    def queue_wait_s(self) -> float:
        return self.admitted_s - self.arrival_s

    @property
    def ttft_s(self) -> float:
        """Time to first token: arrival to the first output token."""
        return self.token_times_s[0] - self.arrival_s

    @property
    def e2e_s(self) -> float:
        """End to end: arrival to the last output token."""
        return self.token_times_s[-1] - self.arrival_s

    @property
    def itl_s(self) -> list[float]:
        """Inter-token latencies: the gaps between consecutive output tokens."""
        times = self.token_times_s
        return [b - a for a, b in zip(times, times[1:])]

    @property
    def tpot_s(self) -> Optional[float]:
        """Time per output token after the first (vLLM's TPOT): (e2e - ttft) / (tokens - 1); None for one token."""
        count = len(self.token_times_s)
        return (self.token_times_s[-1] - self.token_times_s[0]) / (count - 1) if count > 1 else None


@dataclass(frozen=True)
class IterationRecord:
    """One iteration of the run, and the state it left."""

    start_s: float
    end_s: float
    prefill_tokens: int  # prompt tokens computed (recomputation included)
    decodes: int  # sequences that decoded a token
    running: int  # sequences it computed: the running batch (decodes and prompt chunks)
    waiting: int  # arrived requests not admitted
    taken_bytes: int  # bytes of the budget the admitted sequences took while it ran (reserved, blocks, state)
    holding_bytes: int  # of those, the bytes that held tokens


@dataclass(frozen=True)
class ServingOutcome:
    """A finished run: every request's record (in index order) and every iteration's."""

    requests: tuple[RequestRecord, ...]
    iterations: tuple[IterationRecord, ...]
    preemptions: int


class VirtualClock:
    """Time that moves only when told: an iteration takes what its executor says (a simulation, the tests)."""

    def __init__(self):
        self.time = 0.0

    def now(self) -> float:
        return self.time

    def idle_until(self, at: float) -> None:
        self.time = max(self.time, at)

    def ran(self, seconds: float) -> None:
        self.time += seconds


class WallClock:
    """The machine's time from the run's start: an iteration takes what it takes, and the server waits
    for a request that has not arrived yet."""

    def __init__(self):
        self.origin = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self.origin

    def idle_until(self, at: float) -> None:
        wait = at - self.now()
        if wait > 0:
            time.sleep(wait)

    def ran(self, seconds: float) -> None:
        pass  # the time has passed already

"""One member of a measured group: a strategy's session, set up on its own, then stepped in the rounds.

Set-up runs one member at a time, before any round: the strategy's kernel is resolved (a strategy
that cannot run here makes a skipped outcome), its session is made and brought to the first decode
position (the prompt timed, harness.measure.decoding.start_decode), compiled or captured in CUDA graphs
where the point asks, and warmed up at that position. Its own peak memory is read over exactly this
set-up (harness.measure.memory.PeakTracker started right before it): the session's tables, the
prompt's transients and warm-up steps, above whatever the model and the members set up earlier hold.
The rounds (harness.measure.rounds) then time `step()` once per round. A member whose set-up or step
raises keeps its failure (`outcome`) and leaves the rounds; the others go on.
"""
from __future__ import annotations

import traceback
from typing import Callable

import torch

from harness.config import Point
from harness.measure.accuracy import ReferencePasses
from harness.measure.agreement import Disagreement, check_first_step, offer_first_step, reference_first_step
from harness.measure.compiled import CompiledSteps
from harness.measure.graphs import EAGER_WARMUP_STEPS, GraphedSteps
from harness.measure.memory import PeakTracker, shortfall
from harness.measure.decoding import not_run, start_decode
from harness.measure.rounds import Rounds, Step
from harness.measure.threads import FreeCoreThreads
from harness.measure.timing import StepTimer, warm_up
from strategies.base import StrategyUnavailable

PEAK_METHOD = {
    "cpu": "own allocations: resident set growth while this member alone was set up (its session, prompt and "
           "warm-up steps), plus the model's resident bytes; measured before the group's rounds",
    "cuda": "own allocations: max_memory_allocated growth while this member alone was set up (its session, prompt "
            "and warm-up steps), plus the model's allocated bytes; measured before the group's rounds",
}


class Member:
    """A point of a group and, once set up, its live session and the tokens its steps generated."""

    def __init__(self, point: Point, threads: FreeCoreThreads | None = None):
        self.point = point
        self.threads = threads  # the group's thread count fitted to the free cores; None: `threads` throughout
        self.outcome: dict | None = None  # set when the member is skipped or failed: its whole measured dict
        self.steps_taken = 0  # timed steps so far: the round index of the next one
        self.steps_fewer_threads = 0  # timed steps run at fewer torch threads than the point's `threads`
        self.generated: list[torch.Tensor] = []  # [B] per position, the first decode token first
        self.strategy = None  # the strategy object, built at set-up
        self.session = None  # the live DecodeSession, from set-up until release or failure
        self.kernel: str | None = None  # the attention kernel the strategy runs here (the row's `kernel`)
        self.prefill: Rounds | None = None  # the prompt's timings (start_decode; None with prefill=random)
        self.compiled: CompiledSteps | None = None  # the compiled step, where the point compiles
        self.warmup_steps = 0  # warm-up steps taken at the first decode position
        self.memory: dict = {}  # the member's own peak memory, read over its set-up
        self.columns: dict = {}  # what the strategy reports of itself (row_columns) and its agreement figures
        self._graphed: GraphedSteps | None = None  # the captured steps, with timing.cuda_graphs
        self._eager_step = None  # session.step or its compiled form: what an eager round calls
        self._next_token: torch.Tensor | None = None  # a graph's output token, read after its replay [B]

    @property
    def live(self) -> bool:
        return self.outcome is None

    def fail(self, error: BaseException) -> None:
        """Leave the rounds with the error as this member's failed outcome; its session is freed."""
        self.outcome = {"status": "failed", "reason": f"{type(error).__name__}: {error}",
                        "traceback": "".join(traceback.format_exception(type(error), error, error.__traceback__))}
        self.session = self._graphed = None

    def set_up(self, model, model_bytes: int, timer: StepTimer, beside: int = 0,
               references: ReferencePasses | None = None, share_first_step: bool = False) -> None:
        """Resolve, build, prefill, check agreement where the strategy declares bounds
        (harness.measure.agreement), compile or capture, warm up; read the member's own peak. On a reason
        not to run, `outcome` becomes the skipped row's dict and nothing is built. `beside`: members of
        the group set up before this one, whose sessions stay alive beside it; `references`: the group's
        exact reference passes, shared; `share_first_step`: a member of the group checks its agreement, so an
        exact member keeps its first step there (harness.measure.agreement.offer_first_step)."""
        point, device, dtype = self.point, torch.device(self.point.device), getattr(torch, self.point.dtype)
        self.strategy = point.strategy.instantiate()
        self.columns = self.strategy.row_columns()
        try:
            self.kernel = self.strategy.kernel(device, dtype, point.model)
        except StrategyUnavailable as unavailable:
            self.outcome = not_run("skipped", str(unavailable))
            return
        if point.compile != "none" and not type(self.strategy).compilable:
            self.outcome = not_run("skipped", f"compile={point.compile}: {self.strategy.name} does not declare itself "
                                              "compilable (its decode step does not trace into one torch.compile graph)")
            return
        if (reason := shortfall(point, beside)) is not None:  # what the members before it left free
            self.outcome = not_run("skipped", reason)
            return
        bounds = self.strategy.agreement() if point.reference is not None else None
        exact = reference_first_step(point, model, references if references is not None else ReferencePasses()) \
            if bounds is not None else None  # before the peak: the reference's tables are not the member's
        peak = PeakTracker(device)
        peak.start()
        generator = torch.Generator(device=device).manual_seed(point.seed)
        try:
            self.session, first_token, self.prefill = start_decode(
                point, lambda: self.strategy.new_session(model, point.batch, point.max_len), generator, timer)
        except StrategyUnavailable as unavailable:  # a batch or KV type the engine refuses at this point
            self.outcome = not_run("skipped", str(unavailable))
            return
        if share_first_step and references is not None:  # a member after it checks its agreement
            offer_first_step(point, model, self.session, first_token, references)
        if exact is not None:
            try:
                self.columns.update(check_first_step(point, self.strategy, self.session, first_token, exact))
            except Disagreement as disagreement:
                self.columns.update(disagreement.columns)
                raise
        self.generated = [first_token]
        self.compiled = CompiledSteps(self.session, first_token, device, timer.time) if point.compile != "none" else None
        self.warmup_steps = self._warm_up(timer)
        memory = peak.read()
        memory["peak_memory_bytes"] += model_bytes
        self.memory = memory

    def _warm_up(self, timer: StepTimer) -> int:
        """Warm-up steps at the first decode position (the session rewound after each: the tokens stay
        the reference's)."""
        t, session, first_token = self.point.timing, self.session, self.generated[0]
        if t.cuda_graphs:
            graphed = self._graphed = GraphedSteps(session, first_token, self.point.decode_tokens)  # every step, up front
            return EAGER_WARMUP_STEPS + warm_up(graphed.first_step_probe(timer.time), t.warmup_min, t.warmup_max,
                                                t.settle_tolerance)
        self._eager_step = self.compiled.step if self.compiled else session.step  # the prompt ran eager either way

        def first_step_again() -> float:
            _, seconds = timer.time(lambda: self._eager_step(first_token))
            session.rewind(self.point.ctx)
            return seconds

        return warm_up(first_step_again, t.warmup_min, t.warmup_max, t.settle_tolerance)

    def step(self) -> Step:
        """The member's entrant in the group's rounds: one decode step at the round's position (0 ..
        decode_tokens - 1), its input token prepared outside the timed call. The first pass over the
        positions generates the tokens; a later pass rewinds the session at position 0 and feeds the
        first pass's tokens again (the same computation), its outputs dropped."""
        return Step(run=None, before=self._prepare, after=self._record)

    @property
    def follows_torch_threads(self) -> bool:
        """Its steps run at torch's thread count of the moment: not an engine's (its pool was sized at
        its set-up), nor a compiled step's (inductor's kernels fixed their count when compiled)."""
        return type(self.strategy).torch_threads and self.compiled is None

    def _prepare(self) -> Callable[[], torch.Tensor]:
        """Rewind where a pass begins, fit the thread count to the free cores, and bind the step to its
        input token: the call the rounds time."""
        if self.threads is not None and self.follows_torch_threads:
            self.steps_fewer_threads += self.threads.check() < self.threads.asked
        position = self.steps_taken % self.point.decode_tokens
        if self.steps_taken >= self.point.decode_tokens and position == 0:
            self.session.rewind(self.point.ctx)
            if self._graphed is not None:
                self._graphed.restart()
        token = self.generated[position]
        if self._graphed is not None:
            call, self._next_token = self._graphed.prepare_next(token)
            return call
        step, self._next_token = self._eager_step, None
        return lambda: step(token).argmax(-1)

    def _record(self, output) -> None:
        if self.steps_taken < self.point.decode_tokens:  # the first pass: the generated tokens
            self.generated.append(output if self._next_token is None else self._next_token.clone())
        self.steps_taken += 1

    def release(self) -> dict:
        """Free the session; returns what only the live session knew (cache bytes)."""
        cache_bytes = self.session.kv_cache_bytes
        self.session = self._graphed = None
        return {"kv_cache_bytes": cache_bytes}

    def tokens(self) -> torch.Tensor:
        return torch.stack(self.generated, dim=1)  # [B, decode_tokens + 1]: the first pass's

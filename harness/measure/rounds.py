"""The harness's one timing engine: named callables timed together, in rounds.

Every figure the project compares is taken here: the runner's groups (harness.measure.group), the
calibration's best-of kernels (harness.measure.roofs), the benchmark suite (tests/benchmarks) and the
scripts (scripts/). On a shared machine the bandwidth a step gets moves by tens of percent within
minutes, so two callables timed one after the other differ by the machine as much as by themselves.
Here a round times every callable once, in an order that rotates and reverses from round to round
(`rotation`: ABC, CBA, BCA, ACB, ...; or, where asked, always the listed order), so a burst of noise
lands on all of them alike, and round i of two callables is a pair: their ratio in round i is free of
the drift between rounds (harness.measure.intervals gives the medians and paired ratios their
bootstrap intervals).

A read kernel may take a slot in every round too (`roof`, e.g. harness.measure.roofs.GemvRead): the
bandwidth the machine gave in the callables' own window, beside a best-of calibration taken minutes
earlier. Beside callables much faster than it, `roof_share` thins it out: it then sits out a round
while its time so far is above that share of theirs, though never the first round of a pass. Around
the rounds the engine reads the share of the CPUs other processes took (contention).

Rounds come in passes of `RoundsOptions.rounds`; another pass is made while one more fits
`budget_s`, up to `max_passes`, so cheap callables get more rounds and slow ones are not cut short
mid-pass. Usage:

    rounds = time_rounds({"sdpa": step_a, "c": step_b}, RoundsOptions(rounds=12, reference="sdpa"))
    rounds.median("c"), rounds.ratio("c"), rounds.contention
"""
from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from harness.measure.contention import CpuTimes, others_fraction_since
from harness.measure.intervals import Interval, median_interval, paired_ratio
from harness.measure.timing import StepStats, StepTimer

ORDERS = ("rotate", "listed")


@dataclass(frozen=True)
class RoundsOptions:
    """How callables are timed together (time_rounds)."""

    rounds: int = 10  # rounds in one pass: every callable timed once a round
    max_passes: int = 1  # passes at most
    budget_s: float | None = None  # another pass only while it fits this many seconds of rounds; None: max_passes
    warmup: int = 1  # untimed calls of every callable before the first round (allocator, caches, lazy set-up)
    order: str = "rotate"  # rotate: rotation(), so none always runs first or after the same other; listed: as given
    reference: str | None = None  # the callable Rounds.ratio divides by when none is named
    keep_going: bool = False  # a callable that raises leaves the rounds (Rounds.failures) rather than ending them
    read_contention: bool = True  # read /proc/stat around the rounds; off where the caller reads a longer window
    device: str = "cpu"  # the clock: CUDA events on cuda, perf_counter on a CPU (harness.measure.timing)
    cold_cache: bool = False  # zero a 256 MiB buffer before every timed call, outside the timed window
    # the roof kernel sits out a round while its time so far exceeds this share of the callables' (never
    # a pass's first round); None: it runs in every round
    roof_share: float | None = None

    def __post_init__(self):
        if self.order not in ORDERS:
            raise ValueError(f"order must be one of {ORDERS}, got {self.order!r}")
        if self.rounds < 1 or self.max_passes < 1 or self.warmup < 0:
            raise ValueError(f"rounds and max_passes must be >= 1 and warmup >= 0, got {self}")
        if self.roof_share is not None and not self.roof_share > 0:
            raise ValueError(f"roof_share must be above 0 or None, got {self.roof_share}")


@dataclass(frozen=True)
class Step:
    """A callable with untimed work around its timed call: `before` (a rewind, the next input) runs
    right before it, `after` gets its result (the token it produced). A `before` that returns a callable
    hands over the call to time this once (a step bound to its input), so no wrapper frame is timed."""

    run: Callable[[], object] | None  # the timed call; None: the one `before` returns each time
    before: Callable[[], Callable[[], object] | None] | None = None  # untimed, before every timed call (warm-up included)
    after: Callable[[object], None] | None = None  # untimed, with what `run` returned (warm-up excluded)


@dataclass
class Rounds:
    """What time_rounds measured."""

    seconds: dict[str, list[float]]  # per callable, one time per round it ran, in round order
    passes: int  # passes over `rounds` made
    contention: float | None  # share of all cores' time other processes took during the rounds (None: not read)
    method: str  # the clock and the order, for a row's timing_method
    reference: str | None = None  # the default denominator of ratio()
    roof_seconds: list[float] = field(default_factory=list)  # the roof kernel's time in every round it ran in
    roof_bytes: int | None = None  # bytes the roof kernel reads a call
    roof_kernel: str | None = None  # its name (GemvRead.kernel), when it has one
    failures: dict[str, BaseException] = field(default_factory=dict)  # callables that raised (keep_going)

    @property
    def count(self) -> int:
        """Rounds run."""
        return max((len(times) for times in self.seconds.values()), default=len(self.roof_seconds))

    def median(self, name: str) -> Interval:
        """The callable's median time and its bootstrap interval, seconds."""
        return median_interval(self.seconds[name])

    def medians(self) -> dict[str, float]:
        """Every callable's median time, seconds."""
        return {name: self.median(name).median for name in self.seconds if self.seconds[name]}

    def stats(self, name: str) -> StepStats:
        return StepStats.of(self.seconds[name])

    def ratio(self, name: str, reference: str | None = None) -> Interval:
        """The median over rounds of `name`'s time over the reference's in the same round, with its
        interval (whole rounds resampled: the pairs stay together)."""
        return paired_ratio(self.seconds[name], self.seconds[reference or self.reference])

    def ratios(self, reference: str | None = None) -> dict[str, Interval]:
        """ratio() of every other callable that ran every round."""
        reference = reference or self.reference
        return {name: self.ratio(name, reference) for name, times in self.seconds.items()
                if name != reference and name not in self.failures and len(times) == len(self.seconds[reference])}

    @property
    def roof(self) -> Interval | None:
        """The roof kernel's read rate in these rounds, B/s: its median and interval; None without one."""
        if not self.roof_seconds:
            return None
        return median_interval([self.roof_bytes / s for s in self.roof_seconds])


def rotation(entrants: int, round_index: int) -> list[int]:
    """The order of round `round_index`: rotated by half the round index, reversed every other round
    (ABC, CBA, BCA, ACB, ...), so over the rounds every entrant runs in every slot and after every other."""
    shift = (round_index // 2) % entrants
    order = list(range(shift, entrants)) + list(range(shift))
    return order[::-1] if round_index % 2 else order


def time_rounds(steps: Mapping[str, Callable[[], object] | Step], options: RoundsOptions = RoundsOptions(),
                roof=None, timer: StepTimer | None = None) -> Rounds:
    """Time `steps` (name -> callable or Step) together in rounds; `roof`: a read kernel (a callable
    with `nbytes`) timed in every round too; `timer`: a StepTimer to share (else one of options'
    device and cold_cache)."""
    timer = timer or StepTimer(torch.device(options.device), cold_cache=options.cold_cache)
    entrants = {name: step if isinstance(step, Step) else Step(step) for name, step in steps.items()}
    result = Rounds({name: [] for name in entrants}, 0, None, "", options.reference,
                    roof_bytes=getattr(roof, "nbytes", None), roof_kernel=getattr(roof, "kernel", None))
    _warm_up(entrants, options, roof, result)
    slots: list = [*entrants, roof] if roof is not None else list(entrants)
    before = CpuTimes.now() if options.read_contention else None
    began, round_index = time.monotonic(), 0
    timed_s = {"callables": 0.0, "roof": 0.0}  # the timed seconds of each kind of slot so far, for roof_share
    while True:
        for in_pass in range(options.rounds):
            order = range(len(slots)) if options.order == "listed" else rotation(len(slots), round_index)
            for slot in order:
                entrant = slots[slot]
                if isinstance(entrant, str):
                    times = result.seconds[entrant]
                    count = len(times)
                    _time_slot(entrant, entrants, result, options, timer)
                    timed_s["callables"] += times[-1] if len(times) > count else 0.0
                elif not in_pass or options.roof_share is None or timed_s["roof"] <= options.roof_share * timed_s["callables"]:
                    _time_slot(entrant, entrants, result, options, timer)
                    timed_s["roof"] += result.roof_seconds[-1]
            round_index += 1
        result.passes += 1
        spent = time.monotonic() - began
        if result.passes >= options.max_passes or (options.budget_s is not None
                                                   and spent + spent / result.passes > options.budget_s):
            break
    if options.read_contention:
        result.contention = others_fraction_since(before)  # padded to a window /proc/stat resolves
    result.method = timer.method + (", one round at a time in the listed order" if options.order == "listed"
                                    else ", interleaved in rotating order" if len(slots) > 1 else "")
    return result


def _warm_up(entrants: dict[str, Step], options: RoundsOptions, roof, result: Rounds) -> None:
    if roof is not None:
        roof()  # its first touch of its matrix stays out of the rounds
    for name, step in entrants.items():
        for _ in range(options.warmup):
            _guarded(name, result, options, lambda: _untimed(step))


def _time_slot(entrant, entrants: dict[str, Step], result: Rounds, options: RoundsOptions, timer: StepTimer) -> None:
    """One timed call of a round's slot: the roof kernel, or a callable still in the rounds."""
    if not isinstance(entrant, str):
        result.roof_seconds.append(timer.time(entrant)[1])
    elif entrant not in result.failures:
        _guarded(entrant, result, options, lambda: _timed(entrants[entrant], entrant, result, timer))


def _call_of(step: Step) -> Callable[[], object]:
    """The call to time now: what `before` prepared, else the step's own."""
    prepared = step.before() if step.before is not None else None
    return prepared if prepared is not None else step.run


def _untimed(step: Step) -> None:
    _call_of(step)()


def _timed(step: Step, name: str, result: Rounds, timer: StepTimer) -> None:
    call = _call_of(step)
    output, seconds = timer.time(call)
    result.seconds[name].append(seconds)
    if step.after is not None:
        step.after(output)


def _guarded(name: str, result: Rounds, options: RoundsOptions, call: Callable[[], object]) -> None:
    """Run `call`; with keep_going, an exception takes `name` out of the rounds (result.failures)."""
    if not options.keep_going:
        call()
        return
    try:
        call()
    except Exception as error:  # noqa: BLE001 - a callable's failure is its own, not the others'
        result.failures[name] = error

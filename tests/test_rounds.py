"""The timing engine (harness.measure.rounds) on a scripted clock: the order of a round, passes within
a budget, paired ratios through drift, the in-round roof, untimed work around a call, and a callable
that fails (device=cpu; no step of a model is timed here)."""
from __future__ import annotations

import statistics

import pytest
import torch

from harness.measure.rounds import RoundsOptions, Step, rotation, time_rounds


class ScriptedTimer:
    """A StepTimer whose clock is scripted: every call of `fn` takes `cost[name] * drift[round]`
    seconds, where a callable's name is what it returns and the round advances every `per_round` calls."""

    method = "scripted"

    def __init__(self, cost: dict, drift: list[float], per_round: int):
        self.cost, self.drift, self.per_round = cost, drift, per_round
        self.calls: list[str] = []

    def time(self, fn):
        name = fn()
        seconds = self.cost[name] * self.drift[len(self.calls) // self.per_round % len(self.drift)]
        self.calls.append(name)
        return name, seconds


class Roof:
    """A read kernel of 1 GB whose scripted time is cost['roof']."""

    nbytes, kernel = 10**9, "scripted"

    def __call__(self):
        return "roof"


def test_rotation_puts_every_entrant_in_every_slot():
    entrants = 4
    orders = [rotation(entrants, r) for r in range(2 * entrants)]
    assert all(sorted(order) == list(range(entrants)) for order in orders)
    for slot in range(entrants):
        assert {order[slot] for order in orders} == set(range(entrants))
    assert orders[1] == orders[0][::-1]


DRIFT = [1.0, 1.4, 0.8, 1.9, 1.1, 0.7, 1.5, 1.2]  # the machine moving by 2.7x between rounds


def test_a_round_times_every_callable_once_in_rotating_order_and_the_ratio_holds_through_drift():
    timer = ScriptedTimer({"a": 0.010, "b": 0.0105, "roof": 0.05}, DRIFT, per_round=3)
    rounds = time_rounds({"a": lambda: "a", "b": lambda: "b"}, RoundsOptions(rounds=8, reference="a", warmup=0),
                         roof=Roof(), timer=timer)
    assert rounds.count == 8 and rounds.passes == 1 and len(rounds.roof_seconds) == 8
    slots = ["a", "b", "roof"]
    assert timer.calls == [slots[i] for r in range(8) for i in rotation(3, r)]
    assert rounds.ratio("b").median == pytest.approx(1.05) and rounds.ratio("b").low == pytest.approx(1.05)
    assert rounds.median("a").low < rounds.median("a").median < rounds.median("a").high  # the drift, unpaired
    assert set(rounds.ratios()) == {"b"}
    assert rounds.roof.median == pytest.approx(statistics.median(10**9 / (0.05 * d) for d in DRIFT))
    assert rounds.roof_kernel == "scripted"
    assert rounds.contention is not None and "rotating" in rounds.method


def test_a_roof_kernel_far_slower_than_the_callables_sits_out_rounds_but_never_a_passs_first():
    """Beside a callable of 1 ms, a 10 ms read kept to a quarter of its time: timed in round 0 (the
    pass's first), then not until the callable has run 40 ms (round 39), then in round 50, the second
    pass's first; its 30 ms would next need 120 ms of the callable's. Counted: the callable's calls
    before each read (the rotation puts the read after the callable in rounds 0 and 39, before it in 50)."""
    timer = ScriptedTimer({"a": 0.001, "roof": 0.010}, [1.0], per_round=2)
    options = RoundsOptions(rounds=50, max_passes=2, warmup=0, roof_share=0.25)
    rounds = time_rounds({"a": lambda: "a"}, options, roof=Roof(), timer=timer)
    assert rounds.count == 100 and len(rounds.roof_seconds) == 3
    assert [timer.calls[:i].count("a") for i, name in enumerate(timer.calls) if name == "roof"] == [1, 40, 50]
    assert sum(rounds.roof_seconds) <= 0.25 * sum(rounds.seconds["a"]) + 2 * 0.010  # + each pass's first read
    every_round = time_rounds({"a": lambda: "a"}, RoundsOptions(rounds=50, max_passes=2, warmup=0), roof=Roof(),
                              timer=ScriptedTimer({"a": 0.001, "roof": 0.010}, [1.0], per_round=2))
    assert len(every_round.roof_seconds) == 100  # roof_share None: every round
    with pytest.raises(ValueError, match="roof_share"):
        RoundsOptions(roof_share=0)


def test_listed_order_keeps_the_order_given_and_warm_up_calls_are_not_timed():
    timer = ScriptedTimer({"control": 0.02, "step": 0.01}, [1.0], per_round=2)
    warmed = []
    rounds = time_rounds({"control": lambda: "control", "step": Step(lambda: "step", before=lambda: warmed.append(1))},
                         RoundsOptions(rounds=3, warmup=2, order="listed"), timer=timer)
    assert timer.calls == ["control", "step"] * 3
    assert len(warmed) == 2 + 3  # `before` runs before warm-up calls too
    assert rounds.medians() == {"control": 0.02, "step": 0.01}


def test_passes_repeat_while_one_more_fits_the_budget():
    def rounds_with(budget_s, max_passes):
        timer = ScriptedTimer({"a": 0.0}, [1.0], per_round=1)
        return time_rounds({"a": lambda: "a"}, RoundsOptions(rounds=4, max_passes=max_passes, budget_s=budget_s,
                                                             read_contention=False), timer=timer)
    assert rounds_with(None, 3).count == 12  # no budget: max_passes passes
    assert rounds_with(60.0, 5).count == 20  # instant calls: every pass fits
    assert rounds_with(0.0, 5).count == 4  # the first pass always runs


def test_after_gets_each_timed_result_and_before_prepares_each_call():
    produced, inputs = [], iter(range(100))
    current = {}
    step = Step(run=lambda: current["x"] * 2, before=lambda: current.update(x=next(inputs)), after=produced.append)
    rounds = time_rounds({"double": step}, RoundsOptions(rounds=5, warmup=1, read_contention=False))
    assert produced == [2, 4, 6, 8, 10]  # warm-up consumed input 0, its result not recorded
    assert len(rounds.seconds["double"]) == 5


def test_a_call_before_returns_is_the_one_timed():
    """A step bound to its input by `before` is timed itself: no wrapper frame around it."""
    inputs, timed = iter(range(100)), []

    class Timer:
        method = "recording"

        def time(self, call):
            timed.append(call)
            return call(), 1e-3

    def bind():
        x = next(inputs)
        return lambda: x * 3

    produced = []
    rounds = time_rounds({"triple": Step(run=None, before=bind, after=produced.append)},
                         RoundsOptions(rounds=3, warmup=1, read_contention=False), timer=Timer())
    assert produced == [3, 6, 9] and rounds.seconds["triple"] == [1e-3] * 3
    assert [call.__qualname__ for call in timed] == ["test_a_call_before_returns_is_the_one_timed.<locals>.bind.<locals>.<lambda>"] * 3


def test_a_callable_that_raises_leaves_the_rounds_with_keep_going_and_ends_them_without():
    calls = {"ok": 0}

    def explodes_third_time(count=[0]):
        count[0] += 1
        if count[0] == 3:
            raise RuntimeError("planted")

    def fine():
        calls["ok"] += 1

    steps = {"ok": fine, "bad": explodes_third_time}
    rounds = time_rounds(steps, RoundsOptions(rounds=6, warmup=0, keep_going=True, reference="ok",
                                              read_contention=False))
    assert calls["ok"] == 6 and len(rounds.seconds["bad"]) == 2 and "planted" in str(rounds.failures["bad"])
    assert rounds.ratios() == {}  # the failed one has no ratio
    with pytest.raises(ZeroDivisionError):  # without keep_going the first error ends the rounds
        time_rounds({"ok": fine, "bad": lambda: 1 / 0}, RoundsOptions(rounds=3, warmup=0, read_contention=False))


def test_options_are_checked():
    with pytest.raises(ValueError, match="order"):
        RoundsOptions(order="random")
    with pytest.raises(ValueError):
        RoundsOptions(rounds=0)


def test_the_prompt_is_timed_in_rounds_on_a_fresh_session_each_with_an_interval():
    """start_decode times the prompt through the rounds engine: every repeat on a fresh session (a cache
    never sees its prompt twice), at most prefill_repeats, and the median with its interval (the row's
    prefill_s, prefill_ci_low_s, prefill_ci_high_s); the session handed on holds the prompt once."""
    from harness.measure.decoding import PREFILL, start_decode
    from harness.measure.timing import StepTimer
    from harness.model.factory import build_model
    from tests.conftest import planned_point

    point = planned_point("model=tiny", "strategy=contiguous", "ctx=8", "decode_tokens=2", "batch=1", "device=cpu",
                          "timing.prefill_repeats=4")
    model = build_model(point.model, torch.device("cpu"), torch.float32, point.seed, point.matmul, point.batch)
    strategy = point.strategy.instantiate()
    sessions = []

    def new_session():
        sessions.append(strategy.new_session(model, 1, point.max_len))
        return sessions[-1]

    session, first, rounds = start_decode(point, new_session, torch.Generator().manual_seed(0), StepTimer(torch.device("cpu")))
    times = rounds.seconds[PREFILL]
    assert 1 <= len(times) <= 4 and len(sessions) == len(times) and session is sessions[-1]
    interval = rounds.median(PREFILL)
    assert interval.low <= interval.median <= interval.high and interval.median == rounds.stats(PREFILL).p50
    assert first.shape == (1,)

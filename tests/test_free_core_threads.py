"""The thread count fitted to the free cores (harness.measure.threads), on a fake machine: it steps down
when other processes hold a core over a window, back up when they leave, decides nothing on a window
shorter than WINDOW_S, and a group's rows count the timed steps that ran at fewer threads. No timing:
the machine's readings are planted (the benchmark with a real busy process is
tests/benchmarks/test_busy_neighbour.py).
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from harness.measure import group
from harness.measure.contention import CpuTimes
from harness.measure.threads import TAKEN, WINDOW_S, FreeCoreThreads, fitted_threads
from tests.conftest import planned_point


class FakeMachine:
    """CpuTimes readings whose others' cores over each window are planted: read i closes a window of
    `step_s` in which others held others[i] cores (the last value holds on) and this process `mine`."""

    def __init__(self, others: list[float], step_s: float = 1.01 * WINDOW_S, mine: float = 2.0):
        self.others, self.step_s, self.mine = others, step_s, mine
        self.reads = 0
        self.now = CpuTimes(wall=100.0, busy=5000.0, mine=30.0)

    def read(self) -> CpuTimes:
        held = self.others[min(self.reads, len(self.others) - 1)]
        self.reads += 1
        self.now = CpuTimes(self.now.wall + self.step_s, self.now.busy + (held + self.mine) * self.step_s,
                            self.now.mine + self.mine * self.step_s)
        return self.now


def fitted(others: list[float], asked: int = 2, cpus: int = 2, step_s: float = 1.01 * WINDOW_S):
    machine, applied = FakeMachine(others, step_s), []
    return FreeCoreThreads(asked, cpus, read=machine.read, apply=applied.append), applied


def test_it_steps_down_while_a_core_is_taken_and_back_up_when_it_is_free():
    # read 0 opens the first window; then quiet, a neighbour on one core for three windows, quiet again
    threads, applied = fitted([0.0, 0.05, 0.8, 0.9, 0.7, 0.1, 0.0])
    counts = [threads.check() for _ in range(7)]
    assert counts == [2, 2, 1, 1, 1, 2, 2]
    assert applied == [1, 2]  # set only when it changes


def test_no_decision_before_a_window_is_full():
    threads, applied = fitted([0.0, 1.0, 1.0, 1.0], step_s=0.4 * WINDOW_S)
    assert [threads.check() for _ in range(4)] == [2, 2, 2, 1]  # the third read after the first spans WINDOW_S
    assert applied == [1]


@pytest.mark.parametrize("asked, cpus, others, threads", [
    (2, 2, 0.0, 2), (2, 2, TAKEN - 0.01, 2), (2, 2, TAKEN + 0.01, 1),
    (2, 2, 1.9, 1),  # never below one
    (2, 4, 1.8, 2),  # the cores our threads do not use absorb the others
    (2, 4, 2.6, 1),
    (4, 2, 0.0, 4),  # more threads than cores were asked for: kept on a quiet machine
    (4, 2, 1.0, 3),
    (1, 2, 2.0, 1),
])
def test_the_count_is_the_threads_asked_less_the_taken_cores_they_do_not_leave_free(asked, cpus, others, threads):
    assert FreeCoreThreads(asked, cpus, read=None, apply=None).fit(others) == threads


def test_restore_sets_the_threads_asked_and_forgets_the_window():
    threads, applied = fitted([0.0, 1.0, 1.0])
    threads.check(), threads.check()
    threads.restore()
    assert threads.current == 2 and applied == [1, 2]
    assert threads.check() == 2  # a new window opens: no decision on what it read before


def test_only_a_cpu_point_that_asks_for_it_fits_its_threads():
    point = planned_point("model=tiny", "strategy=contiguous")
    assert fitted_threads(point).asked == point.threads
    assert fitted_threads(dataclasses.replace(point, timing=dataclasses.replace(point.timing, adapt_threads=False))) is None
    assert fitted_threads(dataclasses.replace(point, device="cuda")) is None


def test_a_group_counts_the_steps_run_at_fewer_threads_and_restores_the_count(monkeypatch):
    """device=cpu: a group of the exact cache on a fake machine where a neighbour takes a core from the
    group's fourth check on (its set-up's checks none: warm-up steps do not check); the row counts the
    timed steps that then ran at one thread, and torch's count is the point's again after the rounds."""
    point = dataclasses.replace(planned_point("model=tiny", "strategy=contiguous", "ctx=8", "decode_tokens=6",
                                              "timing.max_passes=1"), threads=2)
    machine, seen = FakeMachine([0.0, 0.0, 0.0, 1.0]), []
    threads = FreeCoreThreads(2, 2, read=machine.read, apply=lambda n: (seen.append(n), torch.set_num_threads(n)))
    monkeypatch.setattr(group, "fitted_threads", lambda first: threads)
    before = torch.get_num_threads()
    try:
        row = group.measure_point(point)
        after = torch.get_num_threads()
    finally:
        torch.set_num_threads(before)
    assert row["status"] == "ok" and row["decode_steps_timed"] == 6
    assert row["decode_steps_fewer_threads"] == 3 and seen == [1, 2] and after == 2  # checks 4-6 at one thread

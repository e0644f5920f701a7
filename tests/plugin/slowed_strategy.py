"""A strategy slower than contiguous by a planted fraction: the proof that a group's intervals resolve a
difference of that size (tests/benchmarks/test_interleaving.py) and that the report calls it slower,
not a tie.

Each decode step runs contiguous's step, then waits `slowdown` times that step's own duration (a sleep,
then a spin for the last fraction of a millisecond, which a sleep would overshoot), so the step takes
(1 + slowdown) times as long whatever the machine does meanwhile.
"""
from __future__ import annotations

import time

from strategies.caches.contiguous import ContiguousStrategy

SPIN_S = 2e-4  # the last part of the wait is spun: time.sleep overshoots by tens of microseconds


def wait_until(deadline: float) -> None:
    left = deadline - time.perf_counter()
    if left > SPIN_S:
        time.sleep(left - SPIN_S)
    while time.perf_counter() < deadline:
        pass


class SlowedStrategy(ContiguousStrategy):
    name = "slowed"

    def __init__(self, backend: str = "auto", slowdown: float = 0.05):
        super().__init__(backend=backend)
        self.slowdown = float(slowdown)

    def options(self) -> dict:
        return {**super().options(), "slowdown": self.slowdown}

    def new_session(self, model, batch: int, max_len: int):
        session = super().new_session(model, batch, max_len)
        step, slowdown = session.step, self.slowdown

        def slowed_step(token):
            began = time.perf_counter()
            logits = step(token)
            wait_until(time.perf_counter() + slowdown * (time.perf_counter() - began))
            return logits

        session.step = slowed_step
        return session

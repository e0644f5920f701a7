"""The torch threads a group's steps run with, fitted to the cores other processes leave free.

Why: a decode step of the harness's kernels is about 90 OpenMP parallel regions on a small model,
each ending at a barrier, and libgomp's waiting threads spin (GOMP_SPINCOUNT, 300,000 by default)
before they sleep. With as many threads as cores and another process holding one of them, the
thread that reaches a barrier first spins on its core while the one it waits for queues behind the
other process, and the step loses 2-4x (docs/performance.md, "A busy neighbour"). With one thread
fewer there is no barrier to wait on across the taken core: the step loses what a thread less costs.

So between timed steps (untimed: the member's `before`, harness.measure.member.Member.step) `check`
reads the machine (harness.measure.contention.CpuTimes: /proc/stat's busy time and this process's
own) and, once WINDOW_S has passed since its last decision, counts the cores other processes held over
that window: a core counts as taken when others held at least TAKEN of one. The next window's threads
are the threads asked less the taken cores they do not leave free, at least one. At the lower count
the window still reads the others: when they leave, others' time falls and the count goes back up.
torch.set_num_threads sets the count the harness's C kernels read too (`at::get_num_threads`, in
harness/kernels/csrc/ops_support.h); an engine's pool was sized at its set-up and is left alone.

On a quiet machine nothing changes but one read of /proc/stat per step, outside the timed call.
`timing.adapt_threads=false` keeps the threads asked whatever runs beside them.
"""
from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from harness.measure.contention import CpuTimes, others_cores

# /proc/stat counts in 10 ms ticks per core: a window of 0.1 s on 2 cores is 20 of them, and one
# busy process on a core reads as 5-10 (it shares that core with one of ours at first). Longer windows
# read finer but leave the steps at the wrong count longer after a neighbour comes or goes.
WINDOW_S = 0.1
# A core others held for at least half the window is not free. On an idle 2-core VM others read 0-0.3
# of a core (the hypervisor's steal, this machine's own daemons); one busy process beside 2 threads of
# ours read 0.54-0.91 (0.25 s windows).
TAKEN = 0.5


def fitted_threads(point) -> "FreeCoreThreads | None":
    """The thread count a group of `point`'s process fits to the free cores; None where it keeps the
    point's `threads` (timing.adapt_threads=false, or a GPU runs the steps)."""
    return FreeCoreThreads(point.threads) if point.timing.adapt_threads and point.device == "cpu" else None


@dataclass
class FreeCoreThreads:
    """The thread count a group's process runs its torch steps at, refitted every window."""

    asked: int  # the point's `threads`: the count on a quiet machine, and the most ever set
    cpus: int = field(default_factory=os.cpu_count)  # cores /proc/stat spans
    read: Callable[[], CpuTimes] = CpuTimes.now  # the machine's and this process's CPU time now
    apply: Callable[[int], None] = torch.set_num_threads  # sets the count every later torch op runs at
    window_s: float = WINDOW_S  # the span a decision reads, at least
    current: int = field(init=False)  # the count set now
    _since: CpuTimes | None = field(init=False, default=None)  # the current window's start; None: none yet

    def __post_init__(self):
        self.current = self.asked

    def check(self) -> int:
        """The count to run the next step at: refitted when the window since the last decision is
        full, else as it is."""
        now = self.read()
        if self._since is None:
            self._since = now
        elif now.wall - self._since.wall >= self.window_s:
            self._set(self.fit(others_cores(self._since, now)))
            self._since = now  # the next window reads the count just set, from here
        return self.current

    def fit(self, others: float) -> int:
        """Threads for cores' worth `others` held by other processes: the taken cores beyond those the
        asked threads leave free come off the count, at least one left."""
        taken = math.floor(others + 1 - TAKEN)  # whole cores others held at least TAKEN of
        spare = max(self.cpus - self.asked, 0)  # cores the asked threads never run on
        return max(1, self.asked - max(taken - spare, 0))

    def restore(self) -> None:
        """Back to the threads asked, the window forgotten (after the rounds: what runs next is untimed)."""
        self._set(self.asked)
        self._since = None

    def _set(self, threads: int) -> None:
        if threads != self.current:
            self.apply(threads)
            self.current = threads

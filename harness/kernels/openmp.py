"""How the process's OpenMP threads wait: how long a thread with nothing to do spins before it sleeps,
set in the environment before the OpenMP runtime loads, which is when it reads it.

A decode step of the harness's CPU kernels is tens of OpenMP parallel regions (two per decoder block,
the attention read, the output head; harness/kernels/csrc/), each ending at a barrier, and torch's own
operators and llama.cpp's ggml run on the same libgomp pool (harness.kernels.extension). A libgomp
thread that waits (at a barrier, or for the next region) spins GOMP_SPINCOUNT times before it sleeps
on a futex: 300,000 by default, milliseconds on these CPUs, so within a step no thread ever sleeps. On
cores that are all ours that buys a fast wake-up. With one core taken by another process it is the
order-of-magnitude slowdown: three runnable threads share two cores, the thread that arrives first
spins on one core while the thread it waits for queues behind the neighbour on the other, and the
scheduler sees no idle core to move it to; each of a step's barriers can then cost a time slice.
A shorter spin lets a waiting thread give its core up within tens of microseconds, where the
scheduler's idle balancing moves the descheduled thread onto it; the price is a futex wake-up where a
region begins after a gap longer than the spin, on the quiet machine too: a trade, not a free fix.
At 1,000 spins the exact step's slowdown under one busy core comes down to the engines' (x2.1-3.8
before, x1.8-2.4 after; llama.cpp x2.3-2.7, OpenVINO x1.2-1.5) for 6-24% on the quiet step, in four
measurements; 500 and 300 spins remove more of the one and cost more of the other (17-52% quiet), and
OMP_WAIT_POLICY=PASSIVE (no spin) x1.02-1.04 busy for about 50% quiet. docs/performance.md ("A busy
neighbour") has the figures; tests/benchmarks/test_busy_neighbour.py checks both sides.

`set_wait_policy` runs when the harness package is imported (harness/__init__.py): the runner imports
it before torch, so its own libgomp and the fork server's that its groups run in (started with its
environment) read the setting. A user's own OMP_WAIT_POLICY or GOMP_SPINCOUNT is left as it is.
"""
from __future__ import annotations

from collections.abc import MutableMapping

SPIN_ENV = "GOMP_SPINCOUNT"  # libgomp's spins before a waiting thread sleeps (OMP_WAIT_POLICY's finer form)
SPIN_COUNT = 1000  # tens of microseconds of spinning (docs/performance.md measures 200 to 300,000)
CHOSEN_BY_USER = ("OMP_WAIT_POLICY", SPIN_ENV)  # either set: the user's policy, kept


def set_wait_policy(environ: MutableMapping[str, str]) -> None:
    """GOMP_SPINCOUNT=SPIN_COUNT in `environ`, unless the user chose how OpenMP threads wait. Takes
    effect in a process whose libgomp loads after it (torch imported later, or a child process)."""
    if not any(key in environ for key in CHOSEN_BY_USER):
        environ[SPIN_ENV] = str(SPIN_COUNT)

"""The exact step and the engines' steps with one core taken by a planted busy process: one group's
members (SmolLM2-135M, batch 1, 256 cached tokens: the exact cache, llama.cpp f32, OpenVINO f32), set
up once in this process as a group's process sets them up, then timed in blocks of rounds with the
neighbour running and stopped, the blocks alternating (quiet, busy, busy, quiet, ...) so the machine's
drift lands on both alike. A member's slowdown is its mean step time with the neighbour over its mean
without it: what the neighbour costs each member in the same run, comparable across members.

The exact cache runs twice in the same rounds: as the group runs it (`contiguous`: its thread count
fitted to the free cores, harness.measure.threads, unless the overrides given on the command line say
timing.adapt_threads=false) and at the point's `threads` throughout (FIXED, the harness before the
fitting), each on a session of its own; so what the fitting costs a quiet step is a paired ratio, round
by round, free of the minutes between processes.

Run as its own process (`python -m tests.benchmarks.busy_neighbour [override ...]`), as a group's
process runs: the OpenMP runtime reads the caller's OMP_WAIT_POLICY / GOMP_SPINCOUNT when torch loads
it, so each setting measured is one process started with it.
Prints one JSON line. tests/benchmarks/test_busy_neighbour.py runs it and compares the slowdowns.

The neighbour is `python -c "while True: pass"` pinned to the last CPU. It is this process's child for
exactly one block: killed and reaped when the block ends (finally), and killed by the kernel if this
process dies first (PR_SET_PDEATHSIG), so it never outlives the measurement.
"""
from __future__ import annotations


import contextlib
import ctypes
import json
import os
import signal
import statistics
import subprocess
import sys
import time

import torch

from harness.measure.member import Member
from harness.measure.rounds import RoundsOptions, Step, time_rounds
from harness.measure.threads import FreeCoreThreads, fitted_threads
from harness.measure.timing import StepTimer
from harness.model import build_model
from harness.run.plan import plan

GROUP = ["model=smollm2_135m", "strategy=contiguous,llamacpp_f32,openvino_f32", "batch=1", "ctx=256",
         "decode_tokens=16", "device=cpu"]
EXACT = "contiguous"  # the harness's exact step; the others are the engines
FIXED = "contiguous_fixed"  # the exact step again, at the point's threads whatever runs beside it
BLOCKS = 3  # quiet and busy blocks each
ROUNDS = 10  # rounds a block: every member timed once a round
# After the neighbour starts or stops, before the block's first round: it holds its core by then, and
# the thread count (refitted every harness.measure.threads.WINDOW_S) has seen it come or go
SETTLE_S = 0.2
PR_SET_PDEATHSIG = 1  # prctl option: the signal a child gets when the thread that forked it ends


def _die_with_parent() -> None:
    """In the neighbour, before exec: pinned to the last CPU, and SIGKILLed once its parent is gone."""
    os.sched_setaffinity(0, {max(os.sched_getaffinity(0))})
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() == 1:  # the parent died before prctl: nobody would send the signal
        os._exit(1)


@contextlib.contextmanager
def busy_neighbour(planted: list[int]):
    """A process spinning on one core for the duration of the block; its pid is added to `planted`."""
    neighbour = subprocess.Popen([sys.executable, "-c", "while True: pass"], stdin=subprocess.DEVNULL,
                                 stdout=subprocess.DEVNULL, preexec_fn=_die_with_parent)
    planted.append(neighbour.pid)
    try:
        time.sleep(SETTLE_S)
        yield
    finally:
        neighbour.kill()
        neighbour.wait()


def set_up_members(overrides: list[str]) -> tuple[dict[str, Member], dict[str, str], FreeCoreThreads | None]:
    """The group's members, set up on one model as harness.measure.group does, and the exact one again
    at fixed threads (FIXED); those that cannot run here come back as reasons. Also the group's fitted
    thread count (None: timing.adapt_threads=false)."""
    points = plan(["-m", *GROUP, *overrides], cuda_available=lambda: False).points  # one group, as grouped
    first = points[0]
    torch.set_num_threads(first.threads)
    threads = fitted_threads(first)
    model = build_model(first.model, torch.device("cpu"), torch.float32, first.seed, first.matmul,
                        batch_hint=first.batch)
    timer = StepTimer(torch.device("cpu"))
    live, not_run = {}, {}
    exact = next(point for point in points if point.strategy.name == EXACT)
    for name, member in [*((point.strategy.name, Member(point, threads)) for point in points),
                         (FIXED, Member(exact))]:
        try:
            member.set_up(model, 0, timer, beside=len(live))
        except Exception as error:  # noqa: BLE001 - a member that fails is reported, the others measured
            member.fail(error)
        if member.live:
            live[name] = member
        else:
            not_run[name] = member.outcome["reason"]
    return live, not_run, threads


def at_fixed_threads(member: Member, threads: FreeCoreThreads | None) -> Step:
    """The member's step at the threads asked whatever the fitted count is now, which it leaves as it
    found it (both set outside the timed call)."""
    step = member.step()
    if threads is None:
        return step

    def before():
        torch.set_num_threads(threads.asked)
        return step.before()

    def after(output):
        torch.set_num_threads(threads.current)
        step.after(output)

    return Step(run=None, before=before, after=after)


def measure(members: dict[str, Member], threads: FreeCoreThreads | None,
            planted: list[int]) -> tuple[dict[str, dict[str, list[float]]], dict[str, int]]:
    """Step times in seconds per member and state (quiet, busy), blocks alternating; and the exact
    member's steps run at fewer threads than asked, per state."""
    # No warm-up call in a block (the members warmed up at set-up): an untimed call would advance a session
    # past the position the member's next timed step expects.
    times = {name: {"quiet": [], "busy": []} for name in members}
    fewer = {"quiet": 0, "busy": 0}
    for block in range(2 * BLOCKS):
        state = ("quiet", "busy", "busy", "quiet")[block % 4]
        if state == "quiet" and block % 4 == 3:  # the neighbour just stopped
            time.sleep(SETTLE_S)
        before = members[EXACT].steps_fewer_threads
        with busy_neighbour(planted) if state == "busy" else contextlib.nullcontext():
            rounds = time_rounds({name: at_fixed_threads(member, threads) if name == FIXED else member.step()
                                  for name, member in members.items()},
                                 RoundsOptions(rounds=ROUNDS, warmup=0, read_contention=False))
        fewer[state] += members[EXACT].steps_fewer_threads - before
        for name in members:
            times[name][state] += rounds.seconds[name]
    return times, fewer


def summary(times: dict[str, dict[str, list[float]]]) -> dict[str, dict[str, float]]:
    out = {}
    for name, by_state in times.items():
        quiet, busy = by_state["quiet"], by_state["busy"]
        out[name] = {"quiet_mean_ms": 1e3 * statistics.mean(quiet), "busy_mean_ms": 1e3 * statistics.mean(busy),
                     "quiet_median_ms": 1e3 * statistics.median(quiet), "busy_median_ms": 1e3 * statistics.median(busy),
                     "slowdown": statistics.mean(busy) / statistics.mean(quiet),
                     "median_slowdown": statistics.median(busy) / statistics.median(quiet)}
    if EXACT in times and FIXED in times:  # the fitting's cost, round by round in the quiet blocks
        pairs = zip(times[EXACT]["quiet"], times[FIXED]["quiet"])
        out[EXACT]["quiet_over_fixed"] = statistics.median(ours / fixed for ours, fixed in pairs)
    return out


def main() -> None:
    planted: list[int] = []
    overrides = sys.argv[1:]
    with torch.inference_mode():
        members, not_run, threads = set_up_members(overrides)
        times, fewer = measure(members, threads, planted) if {EXACT, FIXED} <= set(members) else ({}, {})
    print(json.dumps({"environment": {key: os.environ.get(key) for key in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")},
                      "overrides": overrides, "threads": threads.asked if threads else torch.get_num_threads(),
                      "fewer_threads_steps": fewer, "members": summary(times), "not_run": not_run,
                      "planted": planted}))


if __name__ == "__main__":
    main()

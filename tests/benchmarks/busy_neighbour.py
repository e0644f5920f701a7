"""The exact step and the engines' steps with one core taken by a planted busy process: one group's
members (SmolLM2-135M, batch 1, 256 cached tokens: the exact cache, llama.cpp f32, OpenVINO f32), set
up once in this process as a group's process sets them up, then timed in blocks of rounds with the
neighbour running and stopped, the blocks alternating (quiet, busy, busy, quiet, ...) so the machine's
drift lands on both alike. A member's slowdown is its mean step time with the neighbour over its mean
without it: what the neighbour costs each member in the same run, comparable across members.

Run as its own process (`python -m tests.benchmarks.busy_neighbour`), as a group's process runs: the
OpenMP runtime reads the caller's OMP_WAIT_POLICY / GOMP_SPINCOUNT when torch loads it, so each
setting measured is one process started with it.
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
from harness.measure.rounds import RoundsOptions, time_rounds
from harness.measure.timing import StepTimer
from harness.model import build_model
from harness.run.plan import plan

GROUP = ["model=smollm2_135m", "strategy=contiguous,llamacpp_f32,openvino_f32", "batch=1", "ctx=256",
         "decode_tokens=16", "device=cpu"]
EXACT = "contiguous"  # the harness's exact step; the others are the engines
BLOCKS = 3  # quiet and busy blocks each
ROUNDS = 10  # rounds a block: every member timed once a round
SETTLE_S = 0.2  # after the neighbour starts, before the block's first round: it holds its core by then
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


def set_up_members() -> tuple[dict[str, Member], dict[str, str]]:
    """The group's members, set up on one model as harness.measure.group does; those that cannot run
    here come back as reasons."""
    points = plan(["-m", *GROUP], cuda_available=lambda: False).points  # one group: the points as grouped
    first = points[0]
    torch.set_num_threads(first.threads)
    model = build_model(first.model, torch.device("cpu"), torch.float32, first.seed, first.matmul,
                        batch_hint=first.batch)
    timer = StepTimer(torch.device("cpu"))
    live, not_run = {}, {}
    for point in points:
        member = Member(point)
        try:
            member.set_up(model, 0, timer, beside=len(live))
        except Exception as error:  # noqa: BLE001 - a member that fails is reported, the others measured
            member.fail(error)
        if member.live:
            live[point.strategy.name] = member
        else:
            not_run[point.strategy.name] = member.outcome["reason"]
    return live, not_run


def measure(members: dict[str, Member], planted: list[int]) -> dict[str, dict[str, list[float]]]:
    """Step times in seconds per member and state (quiet, busy), blocks alternating."""
    # No warm-up call in a block (the members warmed up at set-up): an untimed call would advance a session
    # past the position the member's next timed step expects.
    times = {name: {"quiet": [], "busy": []} for name in members}
    for block in range(2 * BLOCKS):
        state = ("quiet", "busy", "busy", "quiet")[block % 4]
        with busy_neighbour(planted) if state == "busy" else contextlib.nullcontext():
            rounds = time_rounds({name: member.step() for name, member in members.items()},
                                 RoundsOptions(rounds=ROUNDS, warmup=0, read_contention=False))
        for name in members:
            times[name][state] += rounds.seconds[name]
    return times


def summary(times: dict[str, dict[str, list[float]]]) -> dict[str, dict[str, float]]:
    out = {}
    for name, by_state in times.items():
        quiet, busy = by_state["quiet"], by_state["busy"]
        out[name] = {"quiet_mean_ms": 1e3 * statistics.mean(quiet), "busy_mean_ms": 1e3 * statistics.mean(busy),
                     "quiet_median_ms": 1e3 * statistics.median(quiet), "busy_median_ms": 1e3 * statistics.median(busy),
                     "slowdown": statistics.mean(busy) / statistics.mean(quiet),
                     "median_slowdown": statistics.median(busy) / statistics.median(quiet)}
    return out


def main() -> None:
    planted: list[int] = []
    with torch.inference_mode():
        members, not_run = set_up_members()
        times = measure(members, planted) if EXACT in members else {}
    print(json.dumps({"environment": {key: os.environ.get(key) for key in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")},
                      "threads": torch.get_num_threads(), "members": summary(times), "not_run": not_run,
                      "planted": planted}))


if __name__ == "__main__":
    main()

"""Where a decode step's time goes, per operator: the compressed caches beside the exact one at a point.

Each member (a conf/strategy/ variant on its `c` backend where it has one, or `contiguous`) gets a session
on one seeded model, its cache filled with random K/V (a step's time does not depend on the values);
then (1) their steps timed together in interleaved rounds (harness.measure.rounds: the medians and each
member's ratio to the first member are figures of one run), and (2) each member's steps run under
torch.profiler, whose per-operator self CPU time, divided by the steps, says what a step spends in the
C kernels (`harness_kernels::*`: the attention, the linears, the block halves) and what in torch's small
operators and Python around them ("the rest": the profile's total minus the listed operators).

Points: `heavy` (tests/benchmarks/conftest.py's heavy point: batch 16, 2048 tokens), `smollm2_640`
(SmolLM2-135M's shape, random weights, batch 16, ctx 640: the kv_compression preset's short point).
The figures behind docs/performance.md's "Where a compressed step's time goes". Run it under
`flock /tmp/cpu.lock`:

    python -m tests.benchmarks.step_profile --point heavy contiguous h2o streaming snapkv_int4
"""
from __future__ import annotations

import argparse
import statistics

import torch
from torch.profiler import ProfilerActivity, profile

from harness.measure.rounds import RoundsOptions, time_rounds
from harness.model import build_model
from harness.run.plan import plan
from tests.benchmarks.conftest import DTYPE, MATMUL, POINTS, SEED, filled_session, smollm2_shape


SHAPES = {"heavy": lambda: (POINTS["heavy"].shape, POINTS["heavy"].batch, POINTS["heavy"].ctx),
          "smollm2_640": lambda: (smollm2_shape(), 16, 640)}


def strategy_of(variant: str):
    """conf/strategy/<variant>.yaml's strategy, on its `c` backend where it has one."""
    point = plan(["device=cpu", f"strategy={variant}", "model=tiny", "model.d_model=128", "ctx=16", "decode_tokens=2"],
                 cuda_available=lambda: False).planned[0].point
    choice = point.strategy
    strategy = choice.instantiate()
    if any(backend.name == "c" for backend in strategy.backends):
        strategy = type(strategy)(backend="c", **choice.strategy_options)
    return strategy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--point", choices=sorted(SHAPES), default="heavy")
    parser.add_argument("--steps", type=int, default=20, help="profiled steps per member")
    parser.add_argument("--rounds", type=int, default=15, help="interleaved timing rounds")
    parser.add_argument("--top", type=int, default=6, help="operators listed per member")
    parser.add_argument("members", nargs="+", help="conf/strategy/ names; the first is the ratios' reference")
    args = parser.parse_args()
    shape, batch, ctx = SHAPES[args.point]()
    model = build_model(shape, torch.device("cpu"), DTYPE, SEED, MATMUL, batch_hint=batch)
    sessions = {}
    with torch.inference_mode():
        for name in args.members:
            strategy = strategy_of(name)
            session, token = filled_session(strategy, model, batch, ctx, 2 * args.rounds + args.steps + 8)
            sessions[name] = (session, token, strategy.kernel(torch.device("cpu"), DTYPE, shape))
        rounds = time_rounds({name: (lambda s=s, t=t: s.step(t)) for name, (s, t, _) in sessions.items()},
                             RoundsOptions(rounds=args.rounds, reference=args.members[0]))
        others = "unread" if rounds.contention is None else f"{rounds.contention:.0%}"
        print(f"{args.point}: {shape.name} batch {batch} ctx {ctx}, matmul {MATMUL}, {torch.get_num_threads()} threads; "
              f"others took {others} of the CPUs")
        for name, (session, token, kernel) in sessions.items():
            ratio = rounds.ratio(name)
            print(f"\n{name}: step {rounds.median(name).median * 1e3:.3f} ms, {ratio.median:.3f}x {args.members[0]} "
                  f"[{ratio.low:.3f}-{ratio.high:.3f}]  ({kernel})")
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(args.steps):
                    session.step(token)
            events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
            total = sum(e.self_cpu_time_total for e in events) / args.steps / 1e3  # ms a step
            for event in events[:args.top]:
                per_step = event.self_cpu_time_total / args.steps / 1e3
                print(f"  {event.key:45s} {per_step:7.3f} ms  {event.count // args.steps:4d} calls  "
                      f"{per_step / total:5.1%}")
            listed = sum(e.self_cpu_time_total for e in events[:args.top]) / args.steps / 1e3
            print(f"  {'the rest (' + str(len(events) - args.top) + ' operators, Python)':45s} "
                  f"{total - listed:7.3f} ms  {'':10s} {(total - listed) / total:5.1%}")
            print(f"  {'profiled step':45s} {total:7.3f} ms")


if __name__ == "__main__":
    main()

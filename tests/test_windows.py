"""A slow window (harness.run.windows): a group whose steps, or whose in-round read, fall well outside
what the calibration and the run's other groups predict is measured again, or its rows are flagged
noisy with the reason (device=cpu throughout).

The rule on the figures of a default sweep's batch-4 slice where one group ran in a slow window
(contiguous 28.8 ms a step where the same point takes 15.2 ms; the read in its rounds 18.1 GB/s
against 20-22), and in the runner, on tiny groups one of which is planted slow: its steps wait as long
again as they ran (a 2x slowdown), or its read probe does.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from types import SimpleNamespace

import pandas as pd

from harness.measure import group as measured_group
from harness.measure.rounds import Step
from harness.run import execute
from harness.run.plan import plan
from harness.run.row import model_columns
from harness.run.windows import MeasuredGroup, recheck, slow_reason, step_excess
from tests.conftest import planned_point
from tests.hardening_helpers import seeded
from tests.plugin.slowed_strategy import wait_until

READ, FLOPS = 32e9, 300e9  # calibrated roofs of the synthetic rows


def window(ctx: int, steps_ms: dict, probe_GBps: float, batch: int = 4) -> MeasuredGroup:
    """A measured group of cpu_small at batch x ctx: each strategy's step, the read in its rounds."""
    timed, rows = [], []
    for strategy, step_ms in steps_ms.items():
        point = planned_point("model=cpu_small", f"strategy={strategy}", f"batch={batch}", f"ctx={ctx}")
        timed.append(SimpleNamespace(point=point))
        rows.append({**model_columns(point), "status": "ok", "decode_step_s": step_ms / 1e3, "device": "cpu",
                     "dtype": "float32", "roof_bandwidth_Bps": READ, "roof_flops": FLOPS, "roof_in_rounds_kernel": "c",
                     "roof_bandwidth_in_rounds_Bps": probe_GBps * 1e9, "noisy": False, "noise_reason": ""})
    return MeasuredGroup(f"g{ctx}", timed, set(), rows, 30.0)


# Steps of contiguous and paged (ms) at batch 4, ctx 64 / 256 / 1024, and the read in the rounds (GB/s).
STEADY = {64: ({"contiguous": 14.1, "paged": 14.5}, 21.0), 256: ({"contiguous": 14.4, "paged": 14.9}, 22.0),
          1024: ({"contiguous": 15.2, "paged": 15.9}, 20.5)}


def test_the_slow_window_of_a_default_sweep_is_flagged_and_its_neighbours_are_not():
    slow = {**STEADY, 1024: ({"contiguous": 28.8, "paged": 30.1}, 18.1)}  # its probe fell by a sixth only
    groups = [window(ctx, steps, probe) for ctx, (steps, probe) in slow.items()]
    excess, judged_by = step_excess(groups[2], groups[:2])
    assert judged_by == 2 and 1.6 < excess < 1.9  # 28.8 ms where the work predicts at most 16.4
    assert "its steps took 1.7" in slow_reason(groups[2], groups[:2]) and "read in its rounds" not in slow_reason(groups[2], groups[:2])
    assert slow_reason(groups[0], groups[1:]) is None and slow_reason(groups[1], [groups[0], groups[2]]) is None
    steady = [window(ctx, steps, probe) for ctx, (steps, probe) in STEADY.items()]
    assert all(slow_reason(steady[i], steady[:i] + steady[i + 1:]) is None for i in range(3))


def test_a_read_probe_far_below_the_other_groups_flags_the_window():
    groups = [window(ctx, steps, 12.0 if ctx == 256 else probe) for ctx, (steps, probe) in STEADY.items()]
    reason = slow_reason(groups[1], [groups[0], groups[2]])
    assert reason is not None and "the read in its rounds ran at 12.0 GB/s" in reason and "steps" not in reason


def test_groups_of_another_batch_or_without_roofs_predict_nothing():
    mine = window(1024, {"contiguous": 40.0}, 21.0)
    assert step_excess(mine, [window(1024, {"contiguous": 5.0}, 21.0, batch=1)]) == (None, 0)
    no_roofs = window(256, {"contiguous": 5.0}, 21.0)
    no_roofs.rows[0]["roof_bandwidth_Bps"] = None
    assert step_excess(mine, [no_roofs]) == (None, 0)


def test_a_window_that_stays_slow_when_measured_again_is_flagged_and_one_past_the_budget_is_not_measured():
    slow = {**STEADY, 128: ({"contiguous": 14.2, "paged": 14.6}, 21.5),
            256: ({"contiguous": 30.0, "paged": 31.0}, 21.0), 1024: ({"contiguous": 36.0, "paged": 37.0}, 20.0)}
    groups = [window(ctx, steps, probe) for ctx, (steps, probe) in sorted(slow.items())]
    again = []

    def measure_again(group):  # as slow the second time, and as long as the whole job
        again.append(group.group_id)
        return dataclasses.replace(group, rows=[dict(row) for row in group.rows], seconds=90.0)

    recheck(groups, measure_again)
    assert again == ["g1024"]  # the slowest first; the second would overrun the budget
    assert all(row["noisy"] and "measured again: its steps took" in row["noise_reason"] for row in groups[3].rows)
    assert all(row["noisy"] and "not measured again" in row["noise_reason"] for row in groups[2].rows)
    assert not any(row["noisy"] for group in groups[:2] for row in group.rows)


# The runner: three tiny groups (contiguous beside paged at ctx 8, 16, 32), short rounds.
SWEEP = ["-m", "device=cpu", "model=tiny", "strategy=contiguous,paged", "batch=1", "ctx=8,16,32", "decode_tokens=4",
         "timing.rounds_budget_s=0.3", "timing.max_passes=4", "isolate=false"]


def slowed(run, slowdown: float = 1.0):
    """`run` followed by a wait of `slowdown` times its own duration (tests/plugin/slowed_strategy.py)."""
    def call():
        began = time.perf_counter()
        output = run()
        wait_until(time.perf_counter() + slowdown * (time.perf_counter() - began))
        return output
    return call


def slowed_step(step: Step) -> Step:
    """`step` with every timed call slowed: the call its `before` prepares (a member's step bound to its
    token), else its own `run`."""
    def before():
        prepared = step.before() if step.before is not None else None
        return slowed(prepared if prepared is not None else step.run)
    return Step(None, before, step.after)


def plant_slow_window(monkeypatch, ctx: int, times: int, probe_only: bool = False) -> list:
    """The group at `ctx` runs slow the first `times` times it is measured: every step (or only the read
    probe) takes twice its own time. Returns the ctx of every group measured, in order."""
    measured, real_measure, real_rounds = [], execute.measure_group, measured_group.time_rounds

    def slow_rounds(steps, options, roof, timer):
        if not probe_only:
            steps = {name: slowed_step(step) for name, step in steps.items()}
        # The probe at half speed by reading its bytes twice: a wait after it instead (as `slowed` plants
        # in steps) would let OpenMP's workers sleep, and the member's next step, paying to wake them,
        # would read slow too on a tiny model's sub-millisecond steps.
        roof_call = (lambda: (roof(), roof())[-1]) if probe_only else roof
        return real_rounds(steps, options, _Probe(roof_call, roof) if probe_only else roof_call, timer)

    def measure(request):
        measured.append(request.members[0].ctx)
        if request.members[0].ctx == ctx and measured.count(ctx) <= times:
            with monkeypatch.context() as planted:
                planted.setattr(measured_group, "time_rounds", slow_rounds)
                return real_measure(request)
        return real_measure(request)

    monkeypatch.setattr(execute, "measure_group", measure)
    return measured


class _Probe:
    """A read probe whose call is slowed, its bytes and kernel the real probe's."""

    def __init__(self, call, probe):
        self.call, self.nbytes, self.kernel = call, probe.nbytes, probe.kernel

    def __call__(self):
        return self.call()


def run_sweep(tmp_path) -> pd.DataFrame:
    the_plan = plan([*SWEEP, f"results_dir={seeded(tmp_path)}"], cuda_available=lambda: False)
    execute.measure_groups(the_plan.groups)
    return pd.read_parquet(tmp_path)


def test_the_runner_measures_a_slow_window_again_and_keeps_the_second_measurement(tmp_path, monkeypatch, caplog):
    measured = plant_slow_window(monkeypatch, ctx=16, times=1)
    with caplog.at_level(logging.INFO, logger="harness"):
        rows = run_sweep(tmp_path)
    flagged = [r.getMessage() for r in caplog.records if "a slow window" in r.getMessage()]
    print("\n" + "\n".join(flagged))
    assert measured == [8, 16, 32, 16] and len(flagged) == 1 and "ctx=16" in flagged[0] and "steps took" in flagged[0]
    assert "measured again, in line" in caplog.text
    assert len(rows) == 6 and not rows.noise_reason.str.contains("slow window").any(), rows.noise_reason


def test_the_runner_flags_a_window_that_stays_slow(tmp_path, monkeypatch, caplog):
    measured = plant_slow_window(monkeypatch, ctx=16, times=2)
    with caplog.at_level(logging.INFO, logger="harness"):
        rows = run_sweep(tmp_path)
    slow = rows[rows.ctx == 16]
    print("\n" + slow.noise_reason.iloc[0])
    assert measured == [8, 16, 32, 16] and slow.noisy.all()
    assert not rows[rows.ctx != 16].noise_reason.str.contains("slow window").any()
    assert slow.noise_reason.str.contains("slow window: its steps took .*measured again: its steps took").all()


def test_the_runner_flags_a_read_probe_that_stays_low(tmp_path, monkeypatch):
    plant_slow_window(monkeypatch, ctx=32, times=2, probe_only=True)
    rows = run_sweep(tmp_path)
    slow = rows[rows.ctx == 32]
    print("\n" + slow.noise_reason.iloc[0])
    assert slow.noisy.all() and slow.noise_reason.str.contains("the read in its rounds ran at").all()
    assert not slow.noise_reason.str.contains("steps took").any()

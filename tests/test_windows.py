"""A slow window (harness.run.windows): a group whose steps, or whose in-round read, fall well outside
what the calibration and the run's other groups predict is measured again, or its rows are flagged
noisy with the reason (device=cpu throughout).

The rule on the figures of a default sweep's batch-4 slice where one group ran in a slow window
(contiguous 28.8 ms a step where the same point takes 15.2 ms; the read in its rounds 18.1 GB/s
against 20-22), and in the runner, on tiny groups measured for real whose step and in-round read are then
planted (one group's step twice the others', or its read half), so no verdict depends on what else the
machine runs.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import signal
import subprocess
import sys
from types import SimpleNamespace

import pandas as pd

from harness.run import execute
from harness.run.plan import plan
from harness.run.row import model_columns
from harness.run.windows import REMEASURING, MeasuredGroup, recheck, slow_reason, step_excess
from tests.conftest import REPO_ROOT, planned_point
from tests.hardening_helpers import seeded

READ, FLOPS = 32e9, 300e9  # calibrated roofs of the synthetic rows


def _predicted(row) -> float:
    """The row's predicted step at the roofs (bytes and FLOPs added; the row's predicted_step_s where it has one)."""
    return row.get("predicted_step_s") or (row["bytes_per_step_model"] / row["roof_bandwidth_Bps"]
                                           + row["flops_per_step_model"] / row["roof_flops"])


def window(ctx: int, steps_ms: dict, probe_GBps: float, batch: int = 4) -> MeasuredGroup:
    """A measured group of cpu_small at batch x ctx: each strategy's step, the read in its rounds."""
    timed, rows = [], []
    for strategy, step_ms in steps_ms.items():
        point = planned_point("model=cpu_small", f"strategy={strategy}", f"batch={batch}", f"ctx={ctx}")
        timed.append(SimpleNamespace(point=point))
        rows.append({**model_columns(point, {}), "status": "ok", "decode_step_s": step_ms / 1e3, "device": "cpu",
                     "dtype": "float32", "roof_bandwidth_Bps": READ, "roof_flops": FLOPS, "roof_in_rounds_kernel": "c",
                     "roof_bandwidth_in_rounds_Bps": probe_GBps * 1e9, "noisy": False, "noise_reason": ""})
        rows[-1]["predicted_step_s"] = _predicted(rows[-1])
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


def test_a_member_that_grows_with_context_faster_than_its_bytes_does_not_make_a_clean_window_slow():
    """A slow window slows every member; one whose step outgrows its bytes at every long context (an
    engine computing its attention) leaves the group in line, so the smallest member's excess is the
    group's."""
    grows = {ctx: ({**steps, "paged": steps["paged"] * (2.6 if ctx == 1024 else 1.0)}, probe)
             for ctx, (steps, probe) in STEADY.items()}
    groups = [window(ctx, steps, probe) for ctx, (steps, probe) in grows.items()]
    assert step_excess(groups[2], groups[:2])[0] < 1.1 and slow_reason(groups[2], groups[:2]) is None
    everyone = [window(ctx, {k: v * (1.7 if ctx == 1024 else 1.0) for k, v in steps.items()}, probe)
                for ctx, (steps, probe) in grows.items()]
    assert "its steps took" in slow_reason(everyone[2], everyone[:2])


def test_a_read_probe_far_below_the_other_groups_flags_the_window():
    groups = [window(ctx, steps, 12.0 if ctx == 256 else probe) for ctx, (steps, probe) in STEADY.items()]
    reason = slow_reason(groups[1], [groups[0], groups[2]])
    assert reason is not None and "the read in its rounds ran at 12.0 GB/s" in reason and "steps" not in reason


def test_a_read_probe_is_judged_only_against_groups_of_the_same_members():
    """The probe runs between the members' steps: a group whose members differ (an engine skipped at
    another batch) is no measure of it, while the same members' groups still flag a low read."""
    groups = [window(ctx, steps, probe) for ctx, (steps, probe) in STEADY.items()]
    fewer = window(256, {"contiguous": STEADY[256][0]["contiguous"]}, 12.0)
    assert slow_reason(fewer, [groups[0], groups[2]]) is None
    assert "the read in its rounds" in slow_reason(fewer, [window(64, {"contiguous": 14.1}, 21.0),
                                                           window(1024, {"contiguous": 15.2}, 20.5)])


def test_groups_of_another_batch_or_without_roofs_predict_nothing():
    mine = window(1024, {"contiguous": 40.0}, 21.0)
    assert step_excess(mine, [window(1024, {"contiguous": 5.0}, 21.0, batch=1)]) == (None, 0)
    no_roofs = window(256, {"contiguous": 5.0}, 21.0)
    no_roofs.rows[0]["roof_bandwidth_Bps"] = no_roofs.rows[0]["predicted_step_s"] = None
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


PLANTED_STEP_S, PLANTED_READ_BPS = 1e-3, 20e9  # every group's step and in-round read, as planted


def plant_slow_window(monkeypatch, ctx: int, times: int, probe_only: bool = False) -> list:
    """Each group is measured for real, then its step and in-round read are replaced by planted figures
    (the same step at every ctx, the same read), so the verdicts cannot depend on what else the machine
    runs; the group at `ctx` reads twice that step (or half that read, `probe_only`) the first `times`
    times it is measured. Returns the ctx of every group measured, in order."""
    measured, real_measure = [], execute.measure_group

    def measure(request):
        measured.append(request.members[0].ctx)
        slow = request.members[0].ctx == ctx and measured.count(ctx) <= times
        outcomes = real_measure(request)
        for outcome in outcomes:
            if outcome.get("status") == "ok":
                outcome["decode_step_s"] = PLANTED_STEP_S * (2 if slow and not probe_only else 1)
                outcome["roof_bandwidth_in_rounds_Bps"] = PLANTED_READ_BPS / (2 if slow and probe_only else 1)
        return outcomes

    def build_row(point, measured_outcome, roofs, parallelism=1):  # a row predicts its step (harness.run.row)
        row = real_build_row(point, measured_outcome, roofs, parallelism)
        if row.get("roof_bandwidth_Bps") and row.get("roof_flops"):
            row.setdefault("predicted_step_s", _predicted(row))
        return row

    real_build_row = execute.build_row
    monkeypatch.setattr(execute, "measure_group", measure)
    monkeypatch.setattr(execute, "build_row", build_row)
    return measured


def run_sweep(tmp_path) -> pd.DataFrame:
    the_plan = plan([*SWEEP, f"results_dir={seeded(tmp_path)}"], cuda_available=lambda: False)
    execute.measure_groups(execute.RunContext(), the_plan.groups)
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


def test_a_run_killed_while_a_slow_window_is_measured_again_leaves_it_flagged_and_the_rerun_measures_it(
        tmp_path, caplog):
    """SIGKILL during the second measurement: the slow group's rows on disk already say so (noisy, the
    REMEASURING flag), and the next run measures them again rather than keeping them as done."""
    results = seeded(tmp_path)
    script = ("import os, signal, pytest\n"
              "from harness.run import execute\n"
              "from harness.run.plan import plan\n"
              "from tests.test_windows import SWEEP, plant_slow_window\n"
              "plant_slow_window(pytest.MonkeyPatch(), ctx=16, times=1)\n"
              "execute.measure_again = lambda context, window: os.kill(os.getpid(), signal.SIGKILL)\n"
              f"the_plan = plan([*SWEEP, 'results_dir={results}'], cuda_available=lambda: False)\n"
              "execute.measure_groups(execute.RunContext(), the_plan.groups)\n")
    killed = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO_ROOT)}, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    rows = pd.read_parquet(results)
    assert len(rows) == 6
    flagged = rows.noise_reason.str.contains(REMEASURING, regex=False)
    assert (flagged == (rows.ctx == 16)).all() and rows[flagged].noisy.all(), rows[["ctx", "noise_reason"]]
    with caplog.at_level(logging.INFO, logger="harness"):
        rerun = run_sweep(tmp_path)
    assert caplog.text.count("its group's slow window was being measured again") == 2  # the two ctx=16 rows
    assert caplog.text.count("already measured, skipped") == 4
    assert not rerun.noise_reason.str.contains(REMEASURING, regex=False).any()

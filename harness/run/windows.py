"""A slow window: a group of the run whose steps, or whose in-round read, ran well outside what the
calibration and the run's other groups predict; it is measured again, or its rows are flagged.

Interleaving makes a group's ratios hold whatever the machine does in the group's window
(harness.measure.group), but not its absolute figures: on a shared VM a group's whole window can run
slow, every member's step near twice its usual time, while the read probe in its rounds falls by a
sixth, contention stays under 1% and every ratio holds. Nothing inside the group tells. So once a
sweep's groups are measured, each is set against the sweep's other groups:

- **steps**: each member's step against the same variant (strategy and options, linear kernel,
  compile mode) in every other group of the same shape but for ctx and repeat (model, dtype, device,
  batch, timing, threads, pages alike): the other group's step scaled by the ratio of the two rows'
  predicted step times (`predicted_step_s`, the analytic model at the calibrated roofs), and never
  scaled down (a step with less work still pays its per-step overhead), so the prediction is an upper
  bound. The median over the other groups is a member's excess, and the smallest member's is the
  group's: a slow window slows every member, while one member's step may grow with context faster
  than its bytes in every window (an engine whose attention is computed rather than read at a long
  context: 2.6x from ctx 1024 to 4096 where the bytes grow 1.8x), which must not make a clean group
  look slow. Above SLOW_LIMIT the group ran slow.
- **the in-round read** (the same kernel over the same bytes in every group): below 1 / SLOW_LIMIT of
  the median of the sweep's other groups on the same device, dtype and kernel, with the same members
  (the probe runs between their steps, beside their thread pools).

A slow group is measured again, the slowest first: the first always, more while the second
measurements stay within REMEASURE_SHARE of the sweep's measuring time. Its rows are flagged before
(`noisy`, REMEASURING in `noise_reason`), so a run killed meanwhile leaves no unflagged row of a slow
window, and the next run measures them again (harness.run.execute.rerun_reason); only the second
measurement clears the flag: in line, its rows replace the first; still slow (or failed), the rows
stay flagged with the reason. Every group of a sweep is judged against the others, also under a
launcher: each group's job hands back what it measured, and the sweep judges them
(harness.run.launch) and measures a slow group again as a further job. A group's rows are written
once, as it finishes, unless its window turns out slow.
"""
from __future__ import annotations

import json
import logging
import statistics
from dataclasses import dataclass

from harness.config.point import FOLLOW_THE_STRATEGY
from harness.store.files import write_row

log = logging.getLogger("harness")

SLOW_LIMIT = 1.4  # a window this many times slower than the other groups predict is flagged
REMEASURE_SHARE = 0.25  # second measurements beyond the first stay within this share of the sweep's measuring time
REMEASURING = "slow window: being measured again"  # in noise_reason until the second measurement ends
NOT_SHAPE = (*FOLLOW_THE_STRATEGY, "ctx", "repeat")  # what comparable groups may differ in


@dataclass
class MeasuredGroup:
    """A group as its job measured it: what was timed, the row built for each member, and how long it took."""

    group_id: str
    timed: list  # harness.run.plan.PlannedPoint of every member timed, in the group's order
    to_write: set  # keys of the members whose rows this measurement writes (a finished reference is only timed)
    rows: list  # every timed member's row, in `timed` order
    seconds: float  # wall time of the group's measurement

    def ok(self) -> list[tuple]:
        """(point, row) of every member that ran."""
        return [(member.point, row) for member, row in zip(self.timed, self.rows) if row["status"] == "ok"]


def _shape(point) -> str:
    identity = {k: v for k, v in point.identity().items() if k not in NOT_SHAPE}
    return json.dumps({**identity, "caches_kv": point.strategy.caches_kv}, sort_keys=True)


def _variant(point) -> str:
    identity = point.identity()
    return json.dumps([identity["strategy"], point.matmul, point.compile], sort_keys=True)


def predicted_step(predicted_step_s) -> float | None:
    """The step time the analytic model predicts for a row at its calibrated roofs: its
    `predicted_step_s` column, the one definition (harness.run.row); None where the row has none
    (no roofs), and then the row predicts nothing here."""
    return predicted_step_s if predicted_step_s else None


def _work(row) -> float | None:
    return predicted_step(row.get("predicted_step_s"))


def step_excess(window: MeasuredGroup, others: list[MeasuredGroup]) -> tuple[float | None, int]:
    """(the window's steps over what the other groups predict: each member's median over the other groups,
    the smallest of the members' (the module docstring); the other groups it was judged against). None
    where no member has a counterpart with roofs."""
    per_member, judged_by = [], set()
    for point, row in window.ok():
        work = _work(row)
        ratios = []
        for index, other in enumerate(others):
            for their_point, theirs in other.ok():
                their_work = _work(theirs)
                if (work is None or their_work is None or _shape(their_point) != _shape(point)
                        or _variant(their_point) != _variant(point)):
                    continue
                ratios.append(row["decode_step_s"] / (theirs["decode_step_s"] * max(1.0, work / their_work)))
                judged_by.add(index)
        if ratios:
            per_member.append(statistics.median(ratios))
    return (min(per_member) if per_member else None), len(judged_by)


def probe_shortfall(window: MeasuredGroup, others: list[MeasuredGroup]) -> tuple[float, float] | None:
    """(the window's in-round read, the median of the other groups' of the same device, dtype and
    kernel and the same members), B/s; None where either is missing. The same members: the probe runs
    between their steps, beside their thread pools; in a peers sweep two batch-1 groups read a third
    below the batch-4 groups, where one engine's member is skipped, and read the same measured again."""
    def reading(group):
        rows = [row for _, row in group.ok() if row.get("roof_bandwidth_in_rounds_Bps")]
        beside = tuple(sorted(_variant(point) for point, _ in group.ok()))  # what the probe ran among
        return (rows[0]["roof_bandwidth_in_rounds_Bps"], (rows[0]["device"], rows[0]["dtype"],
                rows[0]["roof_in_rounds_kernel"], beside)) if rows else (None, None)

    mine, kind = reading(window)
    theirs = [rate for rate, their_kind in map(reading, others) if rate and their_kind == kind]
    return (mine, statistics.median(theirs)) if mine and theirs else None


def slow_reason(window: MeasuredGroup, others: list[MeasuredGroup]) -> str | None:
    """Why the window ran slow against the others, or None when it did not."""
    reasons = []
    excess, judged_by = step_excess(window, others)
    if excess is not None and excess > SLOW_LIMIT:
        reasons.append(f"its steps took {excess:.2f}x what {judged_by} other group(s) of the run predict at the "
                       f"calibrated roofs (limit {SLOW_LIMIT}x)")
    probe = probe_shortfall(window, others)
    if probe is not None and probe[0] * SLOW_LIMIT < probe[1]:
        reasons.append(f"the read in its rounds ran at {probe[0] / 1e9:.1f} GB/s, {probe[0] / probe[1]:.2f}x the "
                       f"{probe[1] / 1e9:.1f} GB/s of the run's other groups (limit 1/{SLOW_LIMIT})")
    return "; ".join(reasons) or None


def recheck(measured: list[MeasuredGroup], measure_again) -> None:
    """Judge every group of the sweep against the others; measure a slow one again (`measure_again`:
    MeasuredGroup -> a second MeasuredGroup, nothing written) where the budget allows, keep the second
    measurement where it is in line, flag the rows that stay slow."""
    slow = {i: reason for i, window in enumerate(measured)
            if (reason := slow_reason(window, measured[:i] + measured[i + 1:])) is not None}
    budget, spent = REMEASURE_SHARE * sum(window.seconds for window in measured), 0.0
    for index in sorted(slow, key=lambda i: -(step_excess(measured[i], measured[:i] + measured[i + 1:])[0] or 0)):
        window, reason, others = measured[index], slow[index], measured[:index] + measured[index + 1:]
        log.warning(f"group {window.group_id} ({_label(window)}): a slow window: {reason}")
        if spent and spent + window.seconds > budget:
            _flag(window, f"{reason}; not measured again (second measurements took {spent:.0f} s of a "
                          f"{budget:.0f} s budget)")
            continue
        _mark_remeasuring(window)  # a kill from here on leaves flagged rows, which the re-run measures again
        log.info(f"group {window.group_id}: measuring again")  # one more job under a launcher, whatever follows
        again = measure_again(window)
        spent += again.seconds
        if len(again.ok()) < len(window.ok()):
            _flag(window, f"{reason}; measured again, a member did not run then: the first measurement kept")
            continue
        still = slow_reason(again, others)
        measured[index] = again
        if still is None:
            log.info(f"group {window.group_id}: measured again, in line with the run's other groups: its rows "
                     f"are the second measurement's")
            _write(again)
        else:
            _flag(again, f"{reason}; measured again: {still}")


def _label(window: MeasuredGroup) -> str:
    point = window.timed[0].point
    return f"{point.model.name} b={point.batch} ctx={point.ctx} {point.device}/{point.dtype}"


def _flagged(row: dict, said: str) -> dict:
    """A copy of the row, noisy, with `said` added to its noise_reason."""
    return {**row, "noisy": True, "noise_reason": "; ".join(filter(None, [row["noise_reason"], said]))}


def _flag(window: MeasuredGroup, reason: str) -> None:
    """The window's rows written again, noisy with the reason added to noise_reason."""
    window.rows = [_flagged(row, f"slow window: {reason}") if row["status"] == "ok" else row for row in window.rows]
    log.warning(f"group {window.group_id}: its rows are flagged noisy: {reason}")
    _write(window)


def _mark_remeasuring(window: MeasuredGroup) -> None:
    """The window's rows written flagged REMEASURING before the second measurement starts; the rows in
    memory stay as measured (the verdict that follows writes them again)."""
    _write(window, [_flagged(row, REMEASURING) if row["status"] == "ok" else row for row in window.rows])


def _write(window: MeasuredGroup, rows: list | None = None) -> None:
    for member, row in zip(window.timed, window.rows if rows is None else rows):
        if member.point.key in window.to_write:
            write_row(member.config.results_dir, row)

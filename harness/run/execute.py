"""Measure planned groups and write their rows: the work of each Hydra job, one group each.

A group (harness.run.grouping) is measured in a process of its own (harness.run.isolation, or the
job's process with isolate=false) by harness.measure.group; each member's row is assembled
(harness.run.row) and written whole (harness.store.files) as soon as the group is done. A member whose
row is finished is kept (unless a rerun rule applies: `rerun_reason`); when others of its group are
measured again, the group's reference is measured with them (its row kept) so their ratios still have a
partner in the same rounds. A group's process that dies fails every member it held, with the reason;
the sweep goes on. What jobs of one process share (the progress line's counts, the calibrations in
use) is a RunContext handed to every call, never a module's state.
"""
from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass, field

from harness.measure.contention import ROOF_LIMIT
from harness.measure.group import GroupRequest, measure_group, reference_index
from harness.measure.ncu import measure_traffic
from harness.measure.decoding import not_run
from harness.run import calibrate, windows
from harness.run.grouping import PlannedGroup
from harness.run.isolation import run_inline, run_isolated
from harness.run.metadata import git_commit, same_code
from harness.run.row import build_row
from harness.run.windows import MeasuredGroup
from harness.serve.point import serve_point
from harness.serve.simulated_point import MEASURED, simulate_point
from harness.store.files import finished_row, write_iterations, write_requests, write_row

log = logging.getLogger("harness")


@dataclass
class Progress:
    """Counts and timing across the points of this process, for the progress line and the summary."""

    total: int = 1  # points this command line expands to
    done: int = 0  # points handled so far (measured, skipped or already present)
    started: float = field(default_factory=time.monotonic)
    measured_seconds: list = field(default_factory=list)  # wall time of each point that ran
    statuses: Counter = field(default_factory=Counter)  # status -> count
    written: int = 0  # rows this process wrote

    def eta_seconds(self) -> float | None:
        if not self.measured_seconds:
            return None
        return (self.total - self.done) * sum(self.measured_seconds) / len(self.measured_seconds)

    def line(self, label: str, outcome: str) -> str:
        elapsed = time.monotonic() - self.started
        eta = self.eta_seconds()
        left = f", ~{clock(eta)} left" if eta is not None and self.done < self.total else ""
        return f"[{self.done}/{self.total}] {label}: {outcome} (elapsed {clock(elapsed)}{left})"


@dataclass
class RunContext:
    """What the groups measured by one process share: handed to every call (a launcher's job gets a
    copy of its own), so no module keeps work, progress or calibrations between jobs."""

    progress: Progress = field(default_factory=Progress)
    parallelism: int = 1  # points the launcher may run at once (hydra.sweeper.max_batch_size, harness.run.launch)
    calibrations: dict = field(default_factory=dict)  # (results_dir, device, dtype) -> Calibration in use
    stored: dict = field(default_factory=dict)  # same key -> True while the record in use came from an earlier run
    planned: dict = field(default_factory=dict)  # point key -> its PlannedPoint as grouped, where this process planned it


def roofs_for(context: RunContext, cfg, point, run, c_linear: bool = False):
    """Stored roofs for the point's device and dtype, measured first if missing (or once per process
    when calibrate=true), with the C linear's read rate where the group runs it (`c_linear`). A failed
    calibration leaves the roofs null rather than stopping the sweep."""
    key = (cfg.results_dir, point.device, point.dtype)
    held = context.calibrations
    if key not in held or (held[key] is not None and not calibrate.covers(held[key], c_linear)):
        try:
            record, measured_now = calibrate.ensure(cfg.results_dir, point.device, point.dtype, cfg.calibrate, run,
                                                      budget_s=cfg.calibration_budget_s, c_linear=c_linear)
        except RuntimeError as error:
            log.warning(f"{error}; rows of {point.device}/{point.dtype} get no roofs")
            record, measured_now = None, False
        if measured_now:
            log.info(
                f"calibrated {point.device}/{point.dtype}: read {record.read_bandwidth_Bps / 1e9:.1f} GB/s, "
                f"matmul {record.matmul_flops / 1e12:.3f} TFLOP/s -> {calibrate.record_path(*key)}"
            )
        elif record is not None and calibrate.is_contended(record):
            log.warning(f"the stored calibration {calibrate.record_path(*key)} ({record.timestamp}) was measured "
                        f"while other processes took {record.contention:.0%} of the CPUs: its roofs are likely "
                        "low; calibrate=true measures them again")
        held[key] = record
        context.stored[key] = record is not None and not measured_now
    return held[key]


def warn_if_beaten(context: RunContext, cfg, point, row: dict) -> None:
    """Once per device and dtype: a row faster than a stored record's roofs says the record is wrong
    (measured on a busy machine, or before a faster kernel), and names the switch that re-measures it."""
    key = (cfg.results_dir, point.device, point.dtype)
    beaten = {name: row[name] for name in ("bandwidth_fraction", "flops_fraction")
              if row.get(name) is not None and row[name] > ROOF_LIMIT}
    if not beaten or not context.stored.get(key):
        return
    context.stored[key] = False  # said once
    record = context.calibrations[key]
    figures = ", ".join(f"{name} {value:.2f}" for name, value in beaten.items())
    log.warning(f"{point.label()} beats the stored calibration {calibrate.record_path(*key)} "
                f"({record.timestamp}): {figures} > {ROOF_LIMIT}, so its roofs are too low; "
                "re-run with calibrate=true")


def clock(seconds: float) -> str:
    minutes, secs = divmod(int(round(seconds)), 60)
    return f"{minutes}:{secs:02d}"


def _outcome(row: dict) -> str:
    if row["status"] != "ok":
        return f"{row['status']}: {row['reason']}"
    if row["workload"] is not None:
        diverged = (f", {row['requests_diverged']} request(s) left the reference's tokens (first at token "
                    f"{row['first_divergence_min']}, margin {row['divergence_margin_min']:.2g})"
                    if row["requests_diverged"] else "")
        return (f"{'simulated, ' if row['simulated'] else ''}ok, {row['serving_requests']} requests in "
                f"{row['serving_duration_s']:.1f} s: "
                f"{row['output_throughput']:.1f} tok/s, TTFT p50 {row['ttft_p50_s'] * 1e3:.0f} ms, TPOT p50 "
                f"{(row['tpot_p50_s'] or 0) * 1e3:.1f} ms, KV holding tokens {row['kv_utilization']:.0%} of taken, "
                f"batch up to {row['running_batch_peak']}, {row['preemptions']} preemption(s){diverged}")
    step_ms = row["decode_step_s"] * 1e3
    interval = (f" [{row['decode_step_ci_low_s'] * 1e3:.2f}, {row['decode_step_ci_high_s'] * 1e3:.2f}]"
                if row["decode_step_ci_low_s"] is not None else "")
    ratio = (f", {row['ratio_to_reference']:.3f}x [{row['ratio_ci_low']:.3f}, {row['ratio_ci_high']:.3f}] of "
             f"{row['group_reference']} in the same rounds" if row["ratio_to_reference"] is not None else "")
    bandwidth, flops = row["bandwidth_fraction"], row["flops_fraction"]
    of_roof = (f", roofs: {bandwidth:.0%} of read, {flops:.0%} of FLOP/s ({row['roof_bound']} bound)"
               if bandwidth is not None else "")
    noisy = f"; NOISY: {row['noise_reason']}" if row["noisy"] else ""
    return f"ok, {step_ms:.2f} ms/step{interval}{ratio}, {row['tokens_per_s']:.1f} tok/s{of_roof}{noisy}"


def measured_traffic(point) -> dict:
    """DRAM bytes per step from Nsight Compute; on failure the row keeps traffic_source=model."""
    try:
        return measure_traffic(point)
    except RuntimeError as error:
        log.warning(f"{point.label()}: ncu traffic not measured, traffic_source stays model: {error}")
        return {}


def rerun_reason(row, cfg) -> str | None:
    """Why a point whose row is finished is measured again, or None to keep its row."""
    if cfg.overwrite:
        return "overwrite=true"
    if row.status == "failed" and cfg.rerun_failed:
        return "its row failed (rerun_failed=false keeps failed rows)"
    if windows.REMEASURING in (row.noise_reason or ""):
        return "its group's slow window was being measured again when the run stopped"
    if cfg.rerun_other_code and not same_code(row.git_commit, git_commit()):
        return f"its row was made by other code (git_commit {row.git_commit}; rerun_other_code=true)"
    return None


def _kept(row) -> str:
    """The progress line's outcome for a point whose row is kept."""
    outcome = "already measured, skipped (overwrite=true re-runs it)"
    if row.status == "failed":
        outcome = "already measured: failed, kept (rerun_failed=false)"
    if not same_code(row.git_commit, git_commit()):
        outcome += f"; made by other code (git_commit {row.git_commit}; rerun_other_code=true re-measures it)"
    return outcome


def measure_planned(context: RunContext, planned) -> None:
    """One point alone (a group of one): kept, measured, or a skipped row when it cannot fit."""
    measure_planned_group(context, PlannedGroup(planned.point.key[:12], [planned]))


def measure_groups(context: RunContext, groups: list[PlannedGroup]) -> None:
    """Groups measured in this process, one after another, then each set against the others: a group
    that ran in a slow window is measured again or its rows flagged (harness.run.windows). The same
    as a launcher's sweep (harness.run.launch), without Hydra jobs."""
    context.progress.total = max(context.progress.total, sum(len(group.members) for group in groups))
    measured = [done for group in groups if (done := measure_planned_group(context, group)) is not None]
    windows.recheck(measured, lambda window: measure_again(context, window))


def measure_again(context: RunContext, window: MeasuredGroup) -> MeasuredGroup:
    """A slow window's second measurement: its members timed again, no row written (windows decides)."""
    return measure_timed(context, window.group_id, window.timed, window.to_write, write=False)


def measure_planned_group(context: RunContext, group: PlannedGroup) -> MeasuredGroup | None:
    """A group's members: each kept if its row is finished (and no rerun rule applies), a skipped row
    if it cannot fit, else measured with the group; every row written whole, a progress line each.
    Returns what was measured (None: nothing was)."""
    progress, pending = context.progress, []
    for member in group.members:
        finished = finished_row(member.config.results_dir, member.point.key)
        reason = rerun_reason(finished, member.config) if finished is not None else "new"
        if reason is None:
            progress.done += 1
            progress.statuses["already measured"] += 1
            log.info(progress.line(member.point.label(), _kept(finished)))
            continue
        if finished is not None:
            log.info(f"{member.point.label()}: measuring again: {reason}")
        if member.does_not_fit is not None:
            row = build_row(member.point, not_run("skipped", member.does_not_fit), None, context.parallelism)
            _write(context, member, row, {}, None)
        else:
            pending.append(member)
    if not pending:
        return None
    # The group's reference, finished, is timed again beside the members that are not (its row is kept).
    to_write = {member.point.key for member in pending}
    runnable = [member for member in group.members if member.does_not_fit is None]
    reference = reference_index([member.point for member in runnable])
    timed = [member for i, member in enumerate(runnable) if member.point.key in to_write or i == reference]
    return measure_timed(context, group.group_id, timed, to_write)


def measure_timed(context: RunContext, group_id: str, timed: list, to_write: set,
                  write: bool = True) -> MeasuredGroup | None:
    """`timed` measured as one group, a row built for each; the rows of `to_write` written (unless not
    `write`: a second measurement, whose rows harness.run.windows writes or drops)."""
    first = timed[0]
    run = run_isolated if first.config.isolate else run_inline
    if first.point.serving is not None:  # a serving run: a group of one, in its own process, without roofs
        return _serve_timed(context, group_id, first, run, write)
    roofs = roofs_for(context, first.config, first.point, run, c_linear=any(member.point.matmul == "c" for member in timed))
    began = time.monotonic()
    request = GroupRequest(group_id, tuple(member.point for member in timed), roofs.gemv_kernel if roofs else None)
    outcomes = run(measure_group, request)
    if isinstance(outcomes, dict):  # the group's process failed or died: every member with it
        outcomes = [dict(outcomes) for _ in timed]
    seconds = time.monotonic() - began
    rows = []
    for member, measured in zip(timed, outcomes):
        if member.point.key in to_write and member.point.traffic == "ncu" and measured.get("status") == "ok":
            measured.update(measured_traffic(member.point))
        rows.append(build_row(member.point, measured, roofs, context.parallelism))
        if write and member.point.key in to_write:
            _write(context, member, rows[-1], measured, seconds / len(to_write))
    return MeasuredGroup(group_id, timed, to_write, rows, seconds)


def _serve_timed(context: RunContext, group_id: str, member, run, write: bool) -> None:
    """A serving point served (harness.serve.point), or simulated (harness.serve.simulated_point), and
    its row built; its per-request file and iteration log written first, then its row (the row is what
    makes the point finished, so a run killed between them serves it again). Nothing is handed back: a
    serving run has no decode steps for the slow-window rule to set against other groups'
    (harness.run.windows)."""
    began = time.monotonic()
    if member.point.serving.serving.executor == MEASURED:
        measured = run(serve_point, member.point)
    else:  # a simulation: nothing runs but the scheduler on a virtual clock, in this process
        measured = simulate_point(member.point, member.config.results_dir)
    seconds = time.monotonic() - began
    row = build_row(member.point, measured, None, context.parallelism)
    if write:
        if measured.get("requests"):
            write_requests(member.config.results_dir, row, measured["requests"])
        if measured.get("iterations_log"):
            write_iterations(member.config.results_dir, row, measured["iterations_log"])
        _write(context, member, row, measured, seconds)


def _write(context: RunContext, member, row: dict, measured: dict, seconds: float | None) -> None:
    progress = context.progress
    write_row(member.config.results_dir, row)
    progress.done += 1
    progress.written += 1
    if seconds is not None and row["status"] != "skipped":
        progress.measured_seconds.append(seconds)
    progress.statuses[row["status"]] += 1
    log.info(progress.line(member.point.label(), _outcome(row)))
    warn_if_beaten(context, member.config, member.point, row)
    if "traceback" in measured:
        log.debug(measured["traceback"])

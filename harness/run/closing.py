"""The sweep's closing line, read from the results folder rather than from this process's counters.

Under a launcher that runs points in other processes (submitit's local or Slurm launchers), the parent
measures nothing itself: only the folder knows what landed. So the closing line counts, for every
point of the command line, the row its key names there (harness.store.files.finished_rows: the one
definition of a finished point), names the points that failed or left no row (a job killed, or past
its time limit: the next invocation measures it), and says how to build the report.
"""
from __future__ import annotations

import shlex
from collections import Counter
from dataclasses import dataclass, field

from harness.run.metadata import git_commit, same_code
from harness.store.files import finished_rows

NAMED = 5  # failed or missing points named in the closing line; the rest are counted


@dataclass
class Landed:
    """What the folder holds for the points of one command line."""

    statuses: Counter = field(default_factory=Counter)  # ok | skipped | failed -> points
    failed: list = field(default_factory=list)  # labels of the points whose row failed
    missing: list = field(default_factory=list)  # labels of the points with no finished row

    @property
    def points(self) -> int:
        return sum(self.statuses.values()) + len(self.missing)


def landed(rows: dict, points) -> Landed:
    """For each planned point (objects with `key` and `label()`), the status of its row among the
    folder's finished rows (key -> row, harness.store.files.finished_rows)."""
    out = Landed()
    for point in points:
        row = rows.get(point.key)
        if row is None:
            out.missing.append(point.label())
            continue
        out.statuses[row.status] += 1
        if row.status == "failed":
            out.failed.append(point.label())
    return out


def _named(labels: list) -> str:
    more = f" and {len(labels) - NAMED} more" if len(labels) > NAMED else ""
    return "; ".join(labels[:NAMED]) + more


def closing_line(results_dir: str, points, this_process: Counter, elapsed: str) -> tuple[str, Landed]:
    """The closing line, and what landed for the points of the command line."""
    rows = finished_rows(results_dir)  # the folder read once, for the points and for its own account
    outcome = landed(rows, points)
    counts = ", ".join(f"{outcome.statuses[s]} {s}" for s in ("ok", "skipped", "failed") if outcome.statuses[s])
    text = f"{outcome.points} point(s) in {elapsed}: {counts or 'no row'}"
    if this_process.get("already measured"):
        text += f" ({this_process['already measured']} already measured before this run)"
    if outcome.failed:
        text += f"; failed: {_named(outcome.failed)} (each row's `reason` says why)"
    if outcome.missing:
        text += (f"; {len(outcome.missing)} left no row (a job killed or past its time limit; the same "
                 f"command measures them): {_named(outcome.missing)}")
    text += f". {folder_summary(results_dir, rows)}. Report: python -m harness.report results_dir={shlex.quote(results_dir)}"
    return text, outcome


def folder_summary(results_dir: str, rows: dict) -> str:
    """The folder's account from its finished rows: how many, how many failed, how many other code made."""
    statuses = Counter(row.status for row in rows.values())
    current = git_commit()
    other = sum(not same_code(row.git_commit, current) for row in rows.values())
    text = f"'{results_dir}' holds {len(rows)} rows, {statuses.get('failed', 0)} failed"
    if statuses.get("failed"):
        text += " (the next run re-measures them; rerun_failed=false keeps them)"
    if other:
        text += (f"; {other} made by other code (git_commit is not {current}; rerun_other_code=true "
                 "re-measures them)")
    return text

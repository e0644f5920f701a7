"""Which planned points are timed together, in which order, and which Hydra job measures them.

interleave=shape (the default) puts the points of a sweep that share everything but their strategy,
linear kernel and compile mode (harness.config.Point.group_key: model, dtype, device, batch, ctx,
timing, threads, page size, repeat) into one group, measured in one process with their steps
interleaved (harness.measure.group). interleave=none makes every point a group of its own. A point
that cannot fit in memory is not measured and stays alone (its row is a skipped one).
repeats=N measures every group N times; the groups' order is then shuffled (seeded by the sweep's
seed), so no group always runs first, or always after the same other one.

Hydra runs one job per point. The job that measures a group is its leader: in this process (Hydra's
basic launcher) the first job to run measures every group, in the order above; with a launcher that
runs jobs elsewhere (a Slurm job each) every group's first job measures its group and the other
members' jobs find their rows written by it. A launcher's jobs do not see this process's memory, so
the plan leaves each job its work in a small file under `<results_dir>/_groups/`, named by the job's
overrides.
"""
from __future__ import annotations

import dataclasses
import hashlib
import os
import pickle
import random
from dataclasses import dataclass
from pathlib import Path

GROUPS_DIR = "_groups"  # under results_dir; '_' so pyarrow skips it


@dataclass
class PlannedGroup:
    """Points measured together: one process, one model per linear kernel, steps interleaved."""

    group_id: str  # names the group in its rows: the members' shared key and the repeat
    jobs: list  # the members' harness.run.plan.PlannedPoint, in the sweep's order

    @property
    def points(self) -> tuple:
        return tuple(job.point for job in self.jobs)


def job_key(overrides) -> tuple[str, ...]:
    """How a Hydra job is known across processes: its overrides, sorted."""
    return tuple(sorted(overrides))


def form_groups(jobs: list, interleave: str, repeats: int, seed: int) -> list[PlannedGroup]:
    """The groups to measure, in measuring order. Members of a group of two or more carry
    interleave=shape in their point (and so in their key); every repeat after the first carries its
    index. A point that cannot fit (does_not_fit) stays alone: its row is a skipped one."""
    by_shape: dict[str, list] = {}
    for job in jobs:
        alone = interleave == "none" or job.does_not_fit is not None
        by_shape.setdefault(job.point.key if alone else job.point.group_key(), []).append(job)
    groups = []
    for repeat in range(repeats):
        for members in by_shape.values():
            mode = "shape" if len(members) > 1 else "none"
            copies = [dataclasses.replace(job, point=dataclasses.replace(job.point, interleave=mode, repeat=repeat))
                      for job in members]
            groups.append(PlannedGroup(_group_id(copies), copies))
    if repeats > 1:
        random.Random(seed).shuffle(groups)
    return groups


def _group_id(jobs: list) -> str:
    keys = ",".join(sorted(job.point.key for job in jobs))
    return hashlib.sha256(keys.encode()).hexdigest()[:12]


def leaders(groups: list[PlannedGroup]) -> dict[tuple[str, ...], list[PlannedGroup]]:
    """For a launcher's jobs: each group's first member's job_key -> the groups that job measures."""
    work: dict[tuple[str, ...], list[PlannedGroup]] = {}
    for group in groups:
        work.setdefault(job_key(group.jobs[0].overrides), []).append(group)
    return work


def _file(results_dir, key: tuple[str, ...]) -> Path:
    name = hashlib.sha256("\0".join(key).encode()).hexdigest()[:24]
    return Path(results_dir) / GROUPS_DIR / f"{name}.pkl"


def leave_work(results_dir, jobs: list, work: dict) -> None:
    """One file per job of the sweep: the groups it leads (none for a member another job measures).
    Written atomically; a re-run of the sweep writes them anew."""
    folder = Path(results_dir) / GROUPS_DIR
    folder.mkdir(parents=True, exist_ok=True)
    for job in jobs:
        key = job_key(job.overrides)
        path = _file(results_dir, key)
        temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        temporary.write_bytes(pickle.dumps(work.get(key, [])))
        os.replace(temporary, path)


def find_work(results_dir, overrides) -> list[PlannedGroup] | None:
    """The groups a job of a launcher leads, left by the plan; None when the plan left none (a job
    run without this harness's plan)."""
    try:
        return pickle.loads(_file(results_dir, job_key(overrides)).read_bytes())
    except (OSError, pickle.UnpicklingError, EOFError):
        return None

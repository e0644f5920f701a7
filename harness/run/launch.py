"""A command line's groups run as Hydra jobs, through Hydra's public API: `hydra.main` and a Sweeper plugin.

The plan (harness.run.plan) expands the command line into its groups (harness.run.grouping); `run_jobs`
hands Hydra the plan as its task function, a `GroupJobs`, through `hydra.main`:
- with -m (or a preset's hydra.mode=MULTIRUN), Hydra composes the sweep's config and instantiates the
  sweeper conf/config.yaml chooses, hydra_plugins.harness_sweeper (`hydra/sweeper=harness`), which
  launches one job per group through the configured launcher (Hydra's basic one runs each in this
  process; submitit's local and Slurm ones each in a process or cluster job of its own), each job's
  overrides its first member's plus `+group=<spec>` (`job_overrides`); once they are back it judges the
  groups against each other (harness.run.windows) and launches a slow one again as one further job.
  So a sweep of N groups is N jobs, plus one per slow window measured again. A job of this process
  finds its group's planned members in the RunContext; a job elsewhere plans them again from the spec
  and checks their keys (harness.run.plan.plan_group).
- a single point (no -m) is one job in Hydra's run mode, logged under `<results_dir>/_hydra/run/`,
  which measures every group of the plan in this process: the point's repeats (repeats=N) included.
"""
from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass, field

import hydra

from harness.run.execute import RunContext, measure_groups, measure_planned_group, measure_timed
from harness.run.grouping import GROUP_KEY, GroupSpec, PlannedGroup
from harness.run.plan import CONFIG_DIR, CONFIG_NAME, plan_group
from harness.run.resolve import cuda_available
from harness.run.windows import MeasuredGroup

class SweepStopped(BaseException):
    """A fault that ends the sweep (results_dir full or unwritable). A BaseException, so that Hydra's
    job runner does not record it as one job's failure and go on to the next; app.main() says it in
    one line."""


def is_hydra_override(override: str) -> bool:
    """An override of Hydra's own config (the launcher and its options, the search path, verbosity)."""
    key = override.lstrip("+~").split("=", 1)[0]
    return key == "hydra" or key.startswith(("hydra.", "hydra/"))


def job_overrides(spec: GroupSpec) -> list[str]:
    """A group's job as the launcher runs it: its first member's overrides (Hydra's own left to the
    sweep's config) and `+group=<spec>`, which names its work."""
    first = spec.members[0][1]
    return [o for o in first if not is_hydra_override(o)] + [spec.override()]


def measured_again(window: MeasuredGroup) -> GroupSpec:
    """A slow window's second measurement as a job: its timed members, the rows it is for."""
    return GroupSpec.of(PlannedGroup(window.group_id, window.timed), again=tuple(sorted(window.to_write)))


@dataclass
class GroupJobs:
    """Hydra's task function for a planned command line. Called with a job's config: the group its
    `+group=` override names, measured and its rows written (or, for a second measurement, measured
    and handed back unwritten); in run mode (no group named), every group of the plan."""

    context: RunContext  # this process's progress and calibrations; a launcher's jobs elsewhere get a copy
    groups: list = field(default_factory=list)  # the plan's PlannedGroups, in measuring order (none in a copy sent elsewhere)
    in_process: bool = True  # the launcher runs the jobs in this process, where context.planned holds their members

    @classmethod
    def of(cls, the_plan, context: RunContext) -> "GroupJobs":
        context.planned = {member.point.key: member for group in the_plan.groups for member in group.members}
        return cls(context, list(the_plan.groups), the_plan.in_process)

    def __call__(self, cfg) -> MeasuredGroup | None:
        try:
            if cfg.get(GROUP_KEY) is None:  # run mode: the one job of a command line without -m
                measure_groups(self.context, self.groups)
                return None
            return self._group_job(GroupSpec.decode(cfg[GROUP_KEY]))
        except OSError as error:  # the results folder (a row, a calibration record) cannot be written
            raise SweepStopped(error) from error

    def _group_job(self, spec: GroupSpec) -> MeasuredGroup | None:
        context = self.context
        context.progress.done = max(context.progress.done, spec.first)
        members = [context.planned.get(key) for key, _ in spec.members]
        if None in members:  # a job of another process: its members planned again here
            members = plan_group(spec, cuda_available)
        if spec.again is not None:
            return measure_timed(context, spec.group_id, members, set(spec.again), write=False)
        return measure_planned_group(context, PlannedGroup(spec.group_id, members))

    def specs(self) -> list[GroupSpec]:
        """Each group of the plan as a job's spec, counting the points handled before it."""
        specs, first = [], 0
        for group in self.groups:
            specs.append(GroupSpec.of(group, first))
            first += len(group.members)
        return specs

    def launched_by(self, parallelism: int) -> "GroupJobs":
        """The task a launcher runs `parallelism` jobs at a time: this one, where the jobs run in this
        process; elsewhere a copy without the plan (each job plans its group again from its spec)."""
        self.context.parallelism = parallelism
        if self.in_process:
            return self
        return GroupJobs(dataclasses.replace(self.context, planned={}), [], in_process=False)


def run_jobs(the_plan, context: RunContext) -> None:
    """The plan's groups as Hydra jobs (module docstring). Hydra composes the first job's overrides: the
    sweep's config (where the sweeper and the launcher come from) or the single point's, in the mode the
    plan chose (--run beside a preset's hydra.mode=MULTIRUN runs one point, as planned)."""
    mode = "-m" if the_plan.multirun else "hydra.mode=RUN"
    sys.argv[1:] = [mode, *the_plan.planned[0].overrides] if the_plan.multirun else [*the_plan.planned[0].overrides, mode]
    hydra.main(config_path=CONFIG_DIR, config_name=CONFIG_NAME, version_base="1.3")(GroupJobs.of(the_plan, context))()

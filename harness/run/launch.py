"""A sweep's groups run as Hydra jobs, one job per group, through the launcher the command line chose.

The plan (harness.run.plan) expands the sweep into its groups (harness.run.grouping); this module hands
them to Hydra's launcher plugin (the basic launcher runs each job in this process; submitit's local and
Slurm launchers run each in a process or cluster job of its own) with `launch(job_overrides,
initial_job_idx)`: one job per group, whose overrides are its first member's plus `+group=<spec>`
(harness.run.grouping.GroupSpec). A job of this process finds its group's planned members in the
RunContext; a job elsewhere plans them again from the spec and checks their keys. Each job writes its
group's rows and hands back what it measured; once the launcher returns, the groups are judged
against each other (harness.run.windows) here, and a slow one is measured again as one further job.
So a sweep of N groups is N jobs, plus one per slow window measured again.

A single point (no -m) is one job in Hydra's run mode, logged under `<results_dir>/_hydra/run/`.
"""
from __future__ import annotations

import dataclasses
import functools

from hydra._internal.hydra import Hydra
from hydra._internal.utils import create_config_search_path
from hydra.core.global_hydra import GlobalHydra
from hydra.core.plugins import Plugins
from hydra.core.utils import JobReturn
from hydra.initialize import get_gh_backup, restore_gh_from_backup
from hydra.types import HydraContext, RunMode
from hydra._internal.callbacks import Callbacks

from harness.run import windows
from harness.run.execute import RunContext, measure_planned_group, measure_timed
from harness.run.grouping import GroupSpec, PlannedGroup
from harness.run.plan import CONFIG_DIR, CONFIG_NAME, plan_group
from harness.run.resolve import cuda_available
from harness.run.windows import MeasuredGroup

TASK_NAME = "app"  # Hydra's job name: its log file in each job's folder is app.log, as under hydra.main in app.py


class SweepStopped(BaseException):
    """A fault that ends the sweep (results_dir full or unwritable). A BaseException, so that Hydra's
    job runner does not record it as one job's failure and go on to the next; app.main() says it in
    one line."""


def is_hydra_override(override: str) -> bool:
    """An override of Hydra's own config (the launcher and its options, the search path, verbosity)."""
    key = override.lstrip("+~").split("=", 1)[0]
    return key == "hydra" or key.startswith(("hydra.", "hydra/"))


def run_group_job(context: RunContext, cfg) -> MeasuredGroup | None:
    """A Hydra job's work: the group its `+group=` override names, measured and its rows written (or, for
    a second measurement, measured and handed back unwritten)."""
    spec = GroupSpec.decode(cfg.group)
    context.progress.done = max(context.progress.done, spec.first)
    members = [context.planned.get(key) for key, _ in spec.members]
    if None in members:  # a job of another process: its members planned again here
        members = plan_group(spec, cuda_available)
    try:
        if spec.again is not None:
            return measure_timed(context, spec.group_id, members, set(spec.again), write=False)
        return measure_planned_group(context, PlannedGroup(spec.group_id, members))
    except OSError as error:  # the results folder (a row, a calibration record) cannot be written
        raise SweepStopped(error) from error


@dataclasses.dataclass
class GroupLauncher:
    """Hydra, composed once for the sweep, with its launcher set up to run group jobs."""

    the_plan: object  # harness.run.plan.Plan
    context: RunContext  # this process's progress and calibrations; a launcher's jobs get a copy
    hydra: Hydra | None = None
    master: object = None  # the sweep's config, with Hydra's node (the first job's overrides)
    launcher: object = None
    launched: int = 0  # jobs launched so far: the next job's index

    def __enter__(self) -> "GroupLauncher":
        self._backup = get_gh_backup()
        GlobalHydra.instance().clear()
        self.hydra = Hydra.create_main_hydra2(task_name=TASK_NAME,
                                              config_search_path=create_config_search_path(CONFIG_DIR))
        first = self.the_plan.planned[0].overrides
        if not self.the_plan.multirun:
            return self
        self.master = self.hydra.compose_config(CONFIG_NAME, list(first), run_mode=RunMode.MULTIRUN,
                                                with_log_configuration=True)
        self.context.parallelism = max(1, int(self.master.hydra.sweeper.get("max_batch_size") or 1))
        callbacks = Callbacks(self.master)
        callbacks.on_multirun_start(config=self.master, config_name=CONFIG_NAME)
        # A job elsewhere plans its group again (harness.run.grouping): the plan's points stay here.
        task = functools.partial(run_group_job, self.context if self.the_plan.in_process
                                 else dataclasses.replace(self.context, planned={}))
        self.launcher = Plugins.instance().instantiate_launcher(
            config=self.master, hydra_context=HydraContext(config_loader=self.hydra.config_loader, callbacks=callbacks),
            task_function=task)
        self._callbacks = callbacks
        return self

    def __exit__(self, *exc) -> None:
        if self.master is not None and exc[0] is None:
            self._callbacks.on_multirun_end(config=self.master, config_name=CONFIG_NAME)
        restore_gh_from_backup(self._backup)

    def run(self, specs: list[GroupSpec]) -> list[MeasuredGroup | None]:
        """Each spec's group as one job, `context.parallelism` at a time (Hydra's sweeper batches the
        same way); what each measured, in order. A job that failed raises its error here."""
        if self.master is None:  # one point: Hydra's run mode, in this process
            overrides = [*self._task_overrides(specs[0]), *self._hydra_overrides()]
            ret = self.hydra.run(CONFIG_NAME, functools.partial(run_group_job, self.context), overrides)
            return [ret.return_value]
        measured = []
        step = self.context.parallelism
        for start in range(0, len(specs), step):
            batch = [self._task_overrides(spec) for spec in specs[start:start + step]]
            returns: list[JobReturn] = self.launcher.launch(batch, initial_job_idx=self.launched)
            self.launched += len(batch)
            measured += [ret.return_value for ret in returns]  # a failed job raises its error
        return measured

    def _task_overrides(self, spec: GroupSpec) -> list[str]:
        first = spec.members[0][1]
        return [o for o in first if not is_hydra_override(o)] + [spec.override()]

    def _hydra_overrides(self) -> list[str]:
        return [o for o in self.the_plan.planned[0].overrides if is_hydra_override(o)]


def run_sweep(the_plan, context: RunContext) -> None:
    """Every group of the plan as one job each; then the groups judged against each other, a slow one
    measured again as a further job (harness.run.windows)."""
    context.planned = {member.point.key: member for group in the_plan.groups for member in group.members}
    specs, first = [], 0
    for group in the_plan.groups:
        specs.append(GroupSpec.of(group, first))
        first += len(group.members)
    with GroupLauncher(the_plan, context) as launcher:
        measured = [done for done in launcher.run(specs) if done is not None]

        def measure_again(window: MeasuredGroup) -> MeasuredGroup:
            again = tuple(sorted(window.to_write))
            return launcher.run([GroupSpec.of(PlannedGroup(window.group_id, window.timed), again=again)])[0]

        windows.recheck(measured, measure_again)

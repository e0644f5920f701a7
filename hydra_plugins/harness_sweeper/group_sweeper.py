"""Which jobs a multirun of the harness launches: one per group, then one per slow window measured again.

Hydra's basic sweeper makes a job of every combination of the command line's values: one point each.
The harness times the points of one shape together (harness.run.grouping), so its unit of work is a
group, and once every group is back the groups are judged against each other (harness.run.windows),
a slow one measured again as a further job. That is a sweeper's decision to make, through Hydra's
public plugin interface: the command line was expanded, checked and grouped before Hydra started
(harness.run.plan), and the task function Hydra hands this sweeper (harness.run.launch.GroupJobs)
holds that plan. Each job goes to whichever launcher the config chose (Hydra's basic one in this
process, submitit's local or Slurm one elsewhere), `max_batch_size` at a time, its overrides the
first member's plus `+group=<spec>` (harness.run.grouping.GroupSpec).
"""
# No `from __future__ import annotations`: Hydra's scan runs this module before it is in sys.modules,
# where dataclasses looks up string annotations.
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore
from hydra.core.plugins import Plugins
from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf


@dataclass
class GroupSweeperConf:
    """hydra.sweeper's keys (conf/config.yaml sets them; a preset may set params)."""

    _target_: str = "hydra_plugins.harness_sweeper.group_sweeper.GroupSweeper"
    # groups launched at once: the launcher's own limit (Slurm's array_parallelism), else 1, since a
    # benchmark must not contend with itself; None: 1
    max_batch_size: Optional[int] = None
    # a sweep preset's lists (conf/sweep/), as Hydra's basic sweeper takes them; expanded into points by
    # the harness's plan before Hydra starts, so nothing here reads them
    params: Optional[Dict[str, str]] = None


ConfigStore.instance().store(group="hydra/sweeper", name="harness", node=GroupSweeperConf,
                             provider="kv-decode-harness")


class GroupSweeper(Sweeper):
    """Launches a planned sweep's groups, then its slow windows again, through the configured launcher."""

    def __init__(self, max_batch_size: Optional[int] = None, params: Optional[Dict[str, str]] = None):
        self.max_batch_size = max(1, int(max_batch_size or 1))
        self.config: Optional[DictConfig] = None
        self.jobs: Any = None  # the task function: harness.run.launch.GroupJobs
        self.launcher = None
        self.launched = 0  # jobs launched so far: the next job's index

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        if not callable(getattr(task_function, "launched_by", None)):
            raise TypeError("hydra/sweeper=harness launches the groups of `python -m harness.run` (its task "
                            "function, harness.run.launch.GroupJobs), not another app's jobs")
        self.config, self.jobs = config, task_function
        self.launcher = Plugins.instance().instantiate_launcher(
            hydra_context=hydra_context, task_function=task_function.launched_by(self.max_batch_size), config=config)

    def sweep(self, arguments: List[str]) -> List[Any]:
        """Every group as one job, then each slow window as one more (harness.run.windows); what each
        job measured, in order. `arguments` (the command line's overrides) were planned already."""
        from harness.run import launch, windows  # here: this module is imported wherever Hydra looks for plugins

        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(self.config, sweep_dir / "multirun.yaml")  # the sweep's config, as Hydra's sweepers keep it
        measured = [done for done in self._launch(self.jobs.specs()) if done is not None]
        windows.recheck(measured, lambda window: self._launch([launch.measured_again(window)])[0])
        return measured

    def _launch(self, specs: List[Any]) -> List[Any]:
        """Each spec's group as one job, `max_batch_size` at a time; what each measured. A job that
        failed raises its error here (JobReturn.return_value), as Hydra's basic sweeper does."""
        from harness.run import launch  # here: as in sweep()

        measured = []
        for start in range(0, len(specs), self.max_batch_size):
            batch = [launch.job_overrides(spec) for spec in specs[start:start + self.max_batch_size]]
            returns = self.launcher.launch(batch, initial_job_idx=self.launched)
            self.launched += len(batch)
            measured += [ret.return_value for ret in returns]
        return measured

"""Hydra through its public API: the harness's Sweeper plugin (hydra_plugins/harness_sweeper/), chosen by
conf/config.yaml, decides the jobs a multirun launches (one per group, then each slow window measured
again) and hands them to the configured launcher; a single point is one job of Hydra's run mode that
measures every group of its plan (repeats=N included). The launchers themselves run in the slow tier
(tests/test_cluster.py, test_groups.py, test_runner.py); here the decisions, with a launcher that
records what it is handed."""
from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

import pandas as pd
import pytest
from hydra import compose, initialize_config_dir
from hydra.core.plugins import Plugins
from hydra.plugins.sweeper import Sweeper
from omegaconf import OmegaConf

from harness.config import register_schemas
from harness.run import launch, windows
from harness.run.execute import RunContext
from harness.run.grouping import GROUP_KEY, GroupSpec
from harness.run.plan import CONFIG_DIR, CONFIG_NAME, plan
from harness.run.windows import MeasuredGroup
from hydra_plugins.harness_sweeper.group_sweeper import GroupSweeper
from tests.conftest import REPO_ROOT
from tests.hardening_helpers import FAST, NO_CUDA, cli, seeded

SWEEPER = "hydra_plugins.harness_sweeper.group_sweeper.GroupSweeper"
SWEEP = ["-m", *FAST, "strategy=contiguous,paged", "batch=1,2,3"]  # three groups of two points


def test_no_module_of_the_harness_names_hydras_internals():
    """`hydra._internal` changes without notice between releases: harness/, strategies/ and the plugin
    use Hydra's public modules only, and do not even spell an internal name (a launcher is known by the
    option Hydra records it chose, hydra.runtime.choices, its logger by its `_target_`'s module)."""
    found = [f"{path.relative_to(REPO_ROOT)}:{number}: {line.strip()}"
             for folder in ("harness", "strategies", "hydra_plugins")
             for path in sorted((REPO_ROOT / folder).rglob("*.py"))
             for number, line in enumerate(path.read_text().splitlines(), 1) if "hydra._internal" in line]
    assert not found, "Hydra's internals named:\n" + "\n".join(found)


def test_the_config_chooses_the_harness_sweeper_and_hydra_finds_it():
    register_schemas()
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose(config_name=CONFIG_NAME, return_hydra_config=True)
        assert cfg.hydra.sweeper._target_ == SWEEPER
        assert SWEEPER in {f"{c.__module__}.{c.__qualname__}" for c in Plugins.instance().discover(Sweeper)}
    wheel_packages = (REPO_ROOT / "pyproject.toml").read_text()
    assert '"hydra_plugins.harness_sweeper"' in wheel_packages  # shipped in the wheel (.ci/run checks it there)
    assert not (REPO_ROOT / "hydra_plugins" / "__init__.py").exists()  # Hydra's namespace, shared with other plugins


@dataclasses.dataclass
class Returned:
    return_value: object


class RecordingLauncher:
    """A launcher that runs nothing: it records each batch and hands back, for each job, the group its
    `+group=` override names as if it had been measured."""

    def __init__(self, planned: dict):
        self.planned = planned  # point key -> its PlannedPoint
        self.batches: list[tuple[int, list[list[str]]]] = []

    def launch(self, batch, initial_job_idx):
        self.batches.append((initial_job_idx, [list(job) for job in batch]))
        returned = []
        for job in batch:
            spec = GroupSpec.decode(next(o for o in job if o.startswith(f"+{GROUP_KEY}=")).split("=", 1)[1])
            timed = [self.planned[key] for key, _ in spec.members]
            to_write = set(spec.again or (job.point.key for job in timed))
            returned.append(Returned(MeasuredGroup(spec.group_id, timed, to_write, [], 1.0)))
        return returned


def planned_sweeper(tmp_path, max_batch_size: int) -> tuple[GroupSweeper, RecordingLauncher, object]:
    the_plan = plan([*SWEEP, f"results_dir={tmp_path / 'results'}"], cuda_available=NO_CUDA)
    sweeper, context = GroupSweeper(max_batch_size=max_batch_size), RunContext()
    sweeper.config = OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path / "sweep")}}})
    sweeper.jobs = launch.GroupJobs.of(the_plan, context)
    sweeper.launcher = launcher = RecordingLauncher(context.planned)
    return sweeper, launcher, the_plan


@pytest.mark.parametrize("max_batch_size", [1, 2])
def test_a_multirun_launches_one_job_per_group_then_each_slow_window_again(tmp_path, monkeypatch, max_batch_size):
    sweeper, launcher, the_plan = planned_sweeper(tmp_path, max_batch_size)
    judged = []

    def slow_first(measured, measure_again):  # harness.run.windows decides which window was slow
        judged.append([group.group_id for group in measured])
        measure_again(measured[0])

    monkeypatch.setattr(windows, "recheck", slow_first)
    measured = sweeper.sweep(arguments=["ignored: the plan was made before Hydra started"])

    groups = [group.group_id for group in the_plan.groups]
    assert len(groups) == 3 and judged == [groups] and [group.group_id for group in measured] == groups
    jobs = [job for _, batch in launcher.batches for job in batch]
    specs = [GroupSpec.decode(job[-1].split("=", 1)[1]) for job in jobs]
    assert [spec.group_id for spec in specs] == [*groups, groups[0]]  # every group once, then the slow one again
    assert [spec.again for spec in specs[:-1]] == [None] * 3 and set(specs[-1].again) == {
        member.point.key for member in the_plan.groups[0].members}
    assert [len(batch) for _, batch in launcher.batches] == [max_batch_size] * (3 // max_batch_size) + \
        [1] * (3 % max_batch_size) + [1]  # `max_batch_size` groups at a time, then the window alone
    assert [first for first, _ in launcher.batches] == [sum(len(b) for _, b in launcher.batches[:i])
                                                         for i in range(len(launcher.batches))]
    first_member = the_plan.groups[0].members[0].overrides
    assert jobs[0][:-1] == [o for o in first_member if not launch.is_hydra_override(o)]  # the first member's
    assert (tmp_path / "sweep" / "multirun.yaml").is_file()  # the sweep's config, as Hydra's sweepers keep it


def test_a_launcher_elsewhere_gets_the_task_without_the_plan(tmp_path):
    the_plan = plan([*SWEEP, f"results_dir={tmp_path}"], cuda_available=NO_CUDA)
    jobs = launch.GroupJobs.of(the_plan, RunContext())
    assert jobs.launched_by(4) is jobs and jobs.context.parallelism == 4  # the basic launcher: this process
    elsewhere = dataclasses.replace(jobs, in_process=False).launched_by(2)
    assert elsewhere.groups == [] and elsewhere.context.planned == {} and jobs.context.planned  # planned again there


# The cluster launchers' configs extend hydra-submitit-launcher's (the cluster extra; README's test command
# leaves it out): without it they cannot compose.
NEEDS_SUBMITIT = pytest.mark.skipif(importlib.util.find_spec("hydra_plugins.hydra_submitit_launcher") is None,
                                    reason='hydra-submitit-launcher is not installed (pip install -e ".[cluster]")')


@pytest.mark.parametrize("launcher, here, cls", [(None, True, "BasicLauncher"), ("basic", True, "BasicLauncher"),
                                                 pytest.param("local", False, "LocalLauncher", marks=NEEDS_SUBMITIT),
                                                 pytest.param("slurm", False, "SlurmLauncher", marks=NEEDS_SUBMITIT)])
def test_only_hydras_basic_launcher_runs_the_jobs_in_this_process(tmp_path, launcher, here, cls):
    chosen = [f"hydra/launcher={launcher}"] if launcher else []
    the_plan = plan([*SWEEP, *chosen, f"results_dir={tmp_path}"], cuda_available=NO_CUDA)
    assert the_plan.in_process == here and the_plan.launcher.rpartition(".")[2] == cls  # its module: its logger


def test_the_sweeper_refuses_another_apps_task(tmp_path):
    with pytest.raises(TypeError, match="harness.run.launch.GroupJobs"):
        GroupSweeper(max_batch_size=1).setup(hydra_context=None, task_function=lambda cfg: None,
                                             config=OmegaConf.create({}))


@pytest.mark.slow  # two runs of the CLI
def test_a_single_point_with_repeats_measures_each_and_a_rerun_resumes_the_missing_one(tmp_path):
    results = seeded(tmp_path / "results")
    point = [*FAST, "repeats=3", f"results_dir={results}"]
    done = cli(*point)
    rows = pd.read_parquet(results)
    assert done.returncode == 0, done.stderr[-2000:]
    assert sorted(rows["repeat"]) == [0, 1, 2] and (rows["status"] == "ok").all()
    lost = sorted(results.glob("*.parquet"))[1]
    kept = {path.name: path.stat().st_mtime_ns for path in results.glob("*.parquet") if path != lost}
    lost.unlink()
    again = cli(*point)
    assert again.returncode == 0, again.stderr[-2000:]
    said = again.stdout + again.stderr
    assert "2 already measured" in said and lost.is_file(), said[-2000:]
    assert {path.name: path.stat().st_mtime_ns for path in results.glob("*.parquet") if path != lost} == kept
    assert sorted(pd.read_parquet(results)["repeat"]) == [0, 1, 2]
    assert len(list(Path(results, "_hydra", "run").iterdir())) == 2  # one Hydra run (no multirun) each time

"""Before Hydra runs anything: expand the command line into its points and check every one.

Hydra composes a multirun's config only when a job starts, so a bad value in the fifth point of a
sweep would otherwise surface after four points were written. Here the whole sweep is expanded the way
Hydra's basic sweeper expands it (`sweep_points`: the product of each sweep override's values, through
Hydra's public override parser with the config loader that glob() sweeps need), each point is composed with Hydra's compose API, validated (harness.config.validate: the
same checks the analytic CLI and the report use) and resolved into its Point (harness.run.resolve),
and the first problem ends the run with one line and exit code 2, before a file is written. Each
point is composed and resolved here once; the Hydra job that measures its group then finds its Point by
its overrides (harness.run.launch). CPU points are also checked against free memory here, once. The expansion gives
the sweep's length for the progress line.

Where output goes is decided in one place: `results_dir`. Rows go there, Hydra's logs under its
`_hydra/` (conf/config.yaml, each run's folder named by its start time and its host and process, so
two sweeps started in the same second never share one). Nothing else may move them: an override of a
Hydra key other than the few in harness.run.command_line.HYDRA_KEYS_ALLOWED (hydra.run.dir, hydra.sweep.dir, hydra.job.chdir,
hydra.output_subdir, hydra.job_logging, ...), a preset that changes those settings, a flag that picks
another config, or a results_dir that differs between the points of one sweep is refused. A launcher
may be chosen (hydra/launcher=<option>, and its hydra.launcher.* options other than where it writes);
its jobs may run in another working directory, so results_dir must then be absolute.
"""
from __future__ import annotations

import itertools
import math
import os
import socket
from dataclasses import dataclass, field

import pyarrow as pa
from hydra import initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.initialize import get_gh_backup, restore_gh_from_backup
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from omegaconf import OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from harness.analysis.analytic import weight_bytes
from harness.config import Point, register_schemas
from harness.config.paths import config_dir
from harness.config.validate import INT64_MAX, NAME_CHARACTERS, ConfigError, output_folder, safe_name, validate_run
from harness.measure.memory import available_bytes, shortfall
from harness.measure.decoding import not_run
from harness.run.command_line import (CONFIG_NAME, MULTIRUN_FLAGS, OWN_ARGUMENT_FLAGS, PASS_THROUGH_FLAGS,  # noqa: F401
                                      RUN_FLAGS, check_flag_values, check_flags, check_hydra_keys, check_point_options,
                                      check_output_settings, compose_config, composition_error, hydra_order,
                                      parse_overrides, split_flags)
from harness.run.catalog import strategy_class
from harness.run.effect import check_accuracy_selection, check_checkpoint_shape
from harness.run.grouping import GROUP_KEY, GroupSpec, as_member, form_groups
from harness.run.resolve import point_from_config
from harness.run.row import build_row
from harness.run.variants import variant_of
from harness.serve.checks import check_serving_config, check_serving_fits
from harness.store.columns import SCHEMA
from strategies.base import StrategyOptionError

CONFIG_DIR = str(config_dir())
GPUS_RESOLVER = "harness_gpus"  # ${harness_gpus:${device}} in conf/hydra/launcher/*.yaml: GPUs a job asks for
# Launchers whose jobs run on other hosts: a job checks its device and free memory there (harness.run.app).
REMOTE_LAUNCHERS = ("hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher",)
IN_PROCESS_LAUNCHER = "basic"  # the hydra/launcher option (Hydra's default) that runs every job in this process
RUN_ID_RESOLVER = "harness_run_id"  # ${harness_run_id:} in conf/config.yaml's hydra.run.dir and sweep.dir


def run_id() -> str:
    """What tells apart two runs started in the same second: the host and the process."""
    return f"{socket.gethostname().split('.')[0]}-{os.getpid()}"


# Cached: a launcher's job re-composes the config in its own process, and Hydra copies the parent's
# resolver cache into it, so every job logs under the sweep's one folder (not one named by its own pid).
OmegaConf.register_new_resolver(RUN_ID_RESOLVER, run_id, replace=True, use_cache=True)


def gpus_for(device: str) -> int:
    """GPUs a launcher's job asks for: one for a CUDA point (auto included), none for device=cpu."""
    return 0 if device == "cpu" else 1


OmegaConf.register_new_resolver(GPUS_RESOLVER, gpus_for, replace=True)


@dataclass
class PlannedPoint:
    """One point of the command line, composed, validated and resolved."""

    overrides: tuple[str, ...]  # the point's overrides (a group's job is launched with its first member's)
    config: object  # the composed DictConfig
    point: Point  # the resolved point
    does_not_fit: str | None  # a CPU point that cannot fit in free memory: why (a skipped row in a sweep)


@dataclass
class Plan:
    """What a command line will run."""

    multirun: bool  # one process runs several points
    planned: list[PlannedPoint]  # every point, in Hydra's order
    groups: list = field(default_factory=list)  # harness.run.grouping.PlannedGroup, in measuring order
    in_process: bool = True  # the groups' jobs run in this process (no launcher, or Hydra's basic one)
    launcher: str | None = None  # the launcher's class (hydra.launcher._target_); its module logs each job launched

    @property
    def points(self) -> list[Point]:
        """Every point the command line measures, as grouped (interleave and repeat set)."""
        return [point for group in self.groups for point in group.points]

    @property
    def results_dir(self) -> str:
        """The one folder every row and log of this command line goes to."""
        return str(self.planned[0].config.results_dir)


def needs_preflight(argv: list[str]) -> bool:
    return not any(arg.split("=", 1)[0] in PASS_THROUGH_FLAGS for arg in argv)


def check_shown_config(argv: list[str], cuda_available) -> None:
    """A command line with Hydra's own flags (--cfg job, --info, --help, ...): the config they print is
    composed from its overrides, so those are planned first as a run of them would be (the same one-line
    ConfigError, a value refused or coerced included): what a user inspects is what the runner would
    run. Flags that compose no config of these overrides (--version, --shell-completion, whose
    arguments are not overrides) are left to Hydra."""
    check_flag_values(argv)
    flags, overrides = split_flags(argv)
    if overrides and not any(flag.split("=", 1)[0] in OWN_ARGUMENT_FLAGS for flag in flags):
        plan([*(flag for flag in flags if flag in MULTIRUN_FLAGS + RUN_FLAGS), *overrides], cuda_available)


def plan(argv: list[str], cuda_available) -> Plan:
    """Expand and validate every point of `argv` (the arguments after the program name), and group them.

    Raises ConfigError with one line naming the key and what is allowed.
    """
    command, planned = _planned(argv, cuda_available)
    check_accuracy_selection(planned)
    first = planned[0]
    if first.config.search != "none" and len(planned) > 1:
        raise ConfigError("search", f"{first.config.search} searches the batch of one point: give one strategy, "
                                    "model and ctx (no lists), or search=none for a sweep")
    if not command.multirun and first.does_not_fit is not None:
        key, smaller = memory_key(first.point)
        raise ConfigError(key, f"{first.point.label()} {first.does_not_fit}; choose a smaller {smaller}")
    groups = form_groups(planned, str(first.config.interleave), int(first.config.repeats), first.point.seed)
    return Plan(multirun=command.multirun, planned=planned, groups=groups, in_process=command.in_process,
                launcher=command.launcher)


def _planned(argv: list[str], cuda_available) -> tuple["_CommandLine", list[PlannedPoint]]:
    """The command line and each of its points, composed, validated and resolved."""
    register_schemas()
    check_flags(argv)
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        command = _command_line(argv)
        planned = [_plan_point(overrides, command, cuda_available) for overrides in command.point_overrides]
    _check_distinct(planned)
    return command, planned


def memory_key(point) -> tuple[str, str]:
    """The key a point that cannot fit in its memory is refused on, and what to choose smaller: the
    model where its weights alone take that memory; else a strategy option that sizes the cache apart
    from the sequence (strategies.base.Strategy.cache_allocation_options past it, the largest; its
    cache_cap_option below it); else the largest of batch, ctx and decode_tokens."""
    have = available_bytes(point.device)
    have = min(have, point.memory_limit_bytes) if point.memory_limit_bytes is not None else have
    weights = weight_bytes(point.model, point.dtype)
    if weights >= have:
        return "model", f"model (its weights alone need ~{weights / 2**20:,.1f} MiB)"
    cls, options = strategy_class(point.strategy.strategy_class), point.strategy.strategy_options
    past = {name: options[name] for name in cls.cache_allocation_options
            if isinstance(options.get(name), int) and options[name] > point.max_len}
    cap = cls.cache_cap_option
    option = max(past, key=past.get) if past else cap if cap and options.get(cap, point.max_len) < point.max_len else None
    if option is not None:
        return f"strategy.{option}", f"strategy.{option} or batch"
    sizes = {"batch": point.batch, "ctx": point.ctx, "decode_tokens": point.decode_tokens}
    return max(sizes, key=sizes.get), "batch or ctx"


def plan_group(spec: GroupSpec, cuda_available) -> list[PlannedPoint]:
    """A group's members planned again from their overrides (a launcher's job, in a process of its own),
    as the sweep's plan grouped them; each member's key must be the one the sweep planned (ConfigError
    otherwise: this host composes or resolves the point differently)."""
    backup = get_gh_backup()  # a Hydra job's own GlobalHydra, put back afterwards
    GlobalHydra.instance().clear()
    try:
        members = []
        for key, overrides in spec.members:
            member = as_member(_planned(["-m", *overrides], cuda_available)[1][0], spec.mode, spec.repeat)
            if member.point.key != key:
                raise ConfigError(GROUP_KEY, f"{member.point.label()} plans as key {member.point.key} here, not the "
                                             f"sweep's {key}: the job runs other code or config than the sweep")
            members.append(member)
        return members
    finally:
        restore_gh_from_backup(backup)


# Each strategy option file's own options, composed once per process (the files do not change while it
# runs; the key holds any hydra.searchpath override): a plan composed them again for every command line.
_AS_CHOSEN: dict = {}


@dataclass
class _CommandLine:
    """A command line composed once: what every point of it shares."""

    base: object  # the config composed from the plain overrides (with Hydra's node while multirun)
    multirun: bool  # several points, each composed on its own
    point_overrides: list  # each point's overrides, in Hydra's order
    elsewhere: bool  # a launcher runs the groups' jobs on other hosts
    in_process: bool  # the groups' jobs run in this process (no launcher, or Hydra's basic one)
    launcher: str | None  # the launcher's class (hydra.launcher._target_)


def _command_line(argv: list[str]) -> _CommandLine:
    """Parse and compose the command line, check the Hydra keys it sets and where output goes, and
    expand the sweep the way Hydra's basic sweeper will."""
    overrides = [arg for arg in argv if not arg.startswith("-")]
    parser = OverridesParser.create(config_loader=GlobalHydra.instance().config_loader())
    parsed = parse_overrides(parser, overrides)
    check_hydra_keys(parsed)
    sweeps = [o for o in parsed if o.is_sweep_override()]
    base = _compose_base(parsed)
    launcher = [o.input_line for o in parsed if o.key_or_group == "hydra/launcher"]
    check_output_settings(base, launcher)
    launcher_target = OmegaConf.select(base, "hydra.launcher._target_")
    elsewhere = launcher_target in REMOTE_LAUNCHERS
    if launcher and not os.path.isabs(str(base.results_dir)):
        raise ConfigError("results_dir", f"'{base.results_dir}' is relative, and a launcher's jobs may run in "
                                         "another working directory: give an absolute path")
    flag_run = any(arg in RUN_FLAGS for arg in argv)
    multirun = any(arg in MULTIRUN_FLAGS for arg in argv) or (
        not flag_run and str(base.hydra.mode) in ("MULTIRUN", "RunMode.MULTIRUN"))
    if sweeps and not multirun:
        raise ConfigError(sweeps[0].get_key_element(), "a list of values is a sweep: add -m (--multirun) to run each")
    output_folder("results_dir", base.results_dir)  # Hydra's logs go there even before a job runs
    sweep_params = base.hydra.sweeper.get("params") if multirun else None
    params = OmegaConf.to_container(sweep_params, resolve=False) if sweep_params else {}
    expanded = parse_overrides(parser, [f"{k}={v}" for k, v in params.items()] + overrides)
    check_hydra_keys(expanded)
    point_overrides = sweep_points(expanded)
    # Hydra records the option each config group took (hydra.runtime.choices): the launcher's by its name.
    in_process = not multirun or base.hydra.runtime.choices.get("hydra/launcher") == IN_PROCESS_LAUNCHER
    return _CommandLine(base, multirun, point_overrides, elsewhere, in_process, launcher_target)


def _compose_base(parsed) -> object:
    """What every point shares, composed from the overrides that are not sweeps; where that fails (a sweep
    over `strategy` with a `strategy.*` option the default strategy lacks), with each sweep's first
    value, as the first point will be composed."""
    plain = [o.input_line for o in parsed if not o.is_sweep_override()]
    try:
        return compose_config(plain, with_hydra=True)
    except ConfigError as error:
        sweeps = [o for o in parsed if o.is_sweep_override()]
        try:
            first = [f"{o.get_key_element()}={next(iter(o.sweep_string_iterator()))}" for o in sweeps]
            return compose_config(plain + first, with_hydra=True)
        except StrategyOptionError as lacking:  # the sweep's first strategy lacks it: said of that one
            raise _in_a_sweep(lacking) if any(o.get_key_element() == "strategy" for o in sweeps) else lacking from None
        except (ConfigError, HydraException, StopIteration):
            raise error from None


def _in_a_sweep(error: StrategyOptionError) -> ConfigError:
    """A strategy option that one strategy of a sweep does not take, said of that one, with how to give
    it to the others: every strategy of a sweep gets every `strategy.*` override."""
    return ConfigError(error.key, f"{str(error).removeprefix(error.key + ': ')}; a sweep gives every strategy it "
                                  f"sweeps each strategy.* override: sweep the strategies that take {error.key} apart")


def sweep_points(overrides: list) -> list[list[str]]:
    """Every point's overrides, as Hydra's basic sweeper makes its jobs' ones: a key set twice keeps its first
    place and its last value, and the points are the product of the keys' values, the first key varying slowest."""
    values_by_key: dict[str, list[str]] = {}
    for override in overrides:
        key = override.get_key_element()
        if not override.is_sweep_override():
            values_by_key[key] = [f"{key}={override.get_value_element_as_str()}"]
        elif override.is_discrete_sweep():
            values_by_key[key] = [f"{key}={value}" for value in override.sweep_string_iterator()]
        else:  # interval(): a continuous range, which only a sampling sweeper (Optuna, Nevergrad) can draw from
            raise ConfigError(key, "interval() is a continuous range this sweep cannot enumerate; list the values "
                                   "(a,b,c) or give range(start,stop,step)")
    return [list(point) for point in itertools.product(*values_by_key.values())]


def _plan_point(overrides: list[str], command: _CommandLine, cuda_available) -> PlannedPoint:
    """One point composed (once per point in a sweep), validated and resolved."""
    check_point_options(overrides)
    try:
        cfg = command.base if not command.multirun else compose_config(overrides, with_hydra=True)
    except StrategyOptionError as error:  # composed with another strategy of the sweep before
        raise _in_a_sweep(error) from None
    variant = variant_of(cfg, overrides, lambda listed: compose_config(listed, with_hydra=False), _AS_CHOSEN)
    with open_dict(cfg):  # a point's config is the one Hydra hands its group's job: without Hydra's node
        del cfg["hydra"]
    if str(cfg.results_dir) != str(command.base.results_dir):
        raise ConfigError("results_dir", "one folder per command line (Hydra's logs of a sweep go to one "
                                         "folder): set it once, outside the sweep, and run once per folder")
    if str(cfg.interleave) != str(command.base.interleave) or cfg.repeats != command.base.repeats:
        raise ConfigError("interleave" if str(cfg.interleave) != str(command.base.interleave) else "repeats",
                          "how a sweep's points are grouped is one choice per command line: set it outside the sweep")
    try:
        validate_run(cfg, (lambda: True) if command.elsewhere else cuda_available)
        workload = check_serving_config(cfg) if cfg.get("workload") is not None else None
        point = point_from_config(cfg, variant)
    except OmegaConfBaseException as error:  # a value that only fails when read (a missing field)
        raise composition_error(error) from None
    check_checkpoint_shape(overrides, cfg.model, point.model)
    check_point(point)
    if workload is not None:  # its requests against the model's context and the budget (harness.serve.checks)
        check_serving_fits(cfg, point, workload)
        return PlannedPoint(tuple(overrides), cfg, point, None)
    does_not_fit = shortfall(point) if point.device == "cpu" and not command.elsewhere else None
    return PlannedPoint(tuple(overrides), cfg, point, does_not_fit)


def _check_distinct(planned: list[PlannedPoint]) -> None:
    """Two points that are one (`strategy=quantized,int8`: the same class and options under two names)
    would measure it twice and write one row: refused."""
    seen: dict[str, PlannedPoint] = {}
    for one in planned:
        first = seen.setdefault(one.point.key, one)
        if first is not one:
            names = (first.point.strategy.variant, one.point.strategy.variant)
            raise ConfigError("strategy" if names[0] != names[1] else "command line",
                              f"{first.point.label()} and {one.point.label()} are the same point (the same class, "
                              f"options and sizes: key {one.point.key}); list it once")


def check_point(point: Point) -> None:
    """What only the resolved point can show: the strategy class's name becomes part of the row's file
    name, and every value of its row (the analytic model's byte counts included) fits its column."""
    name = point.strategy.name
    try:
        safe_name("strategy", name)
    except ConfigError:
        raise ConfigError("strategy._target_", f"{point.strategy.strategy_class}.name is {name!r}, which cannot "
                                               f"name a file; a strategy's name uses {NAME_CHARACTERS}") from None
    row = build_row(point, not_run("skipped", "planned"))
    for column in SCHEMA:
        value = row[column.name]
        if value is None or isinstance(value, bool):
            continue
        too_large = pa.types.is_integer(column.type) and not -INT64_MAX - 1 <= value <= INT64_MAX
        if too_large or pa.types.is_floating(column.type) and isinstance(value, float) and not math.isfinite(value):
            key = "model" if column.name == "weight_bytes" else _largest_size(point)
            raise ConfigError(key, f"{point.label()}: the row's {column.name} would be {float(value):.3g}, beyond a "
                                   f"64-bit {'integer' if too_large else 'float'}; choose a smaller {key}")


def _largest_size(point: Point) -> str:
    """The key of the largest size a point sets (batch, ctx, decode_tokens, an integer option of its
    strategy): what a figure of its row too large to store comes from."""
    sizes = {"batch": point.batch, "ctx": point.ctx, "decode_tokens": point.decode_tokens,
             **{f"strategy.{name}": value for name, value in point.strategy.strategy_options.items()
                if isinstance(value, int) and not isinstance(value, bool)}}
    return max(sizes, key=sizes.get)

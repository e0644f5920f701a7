"""Before Hydra runs anything: expand the command line into its points and check every one.

Hydra composes each job of a multirun only when that job starts, so a bad value in the fifth point of
a sweep would otherwise surface after four points were written. Here the whole sweep is expanded the
way Hydra's BasicSweeper expands it (its own `split_arguments`), each job is composed with Hydra's
compose API, validated and resolved into its Point (harness.run.resolve), and the first problem ends
the run with one line and exit code 2, before a file is written. Each point is composed and resolved
here once; Hydra's job then finds its Point by its overrides (harness.run.app). CPU points are also
checked against free memory here, once. The expansion gives the sweep's length for the progress line.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException, MissingConfigException
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from harness.config import Point, register_schemas
from harness.config.paths import config_dir
from harness.config.validate import ConfigError, validate_run
from harness.measure.memory import shortfall
from harness.run.resolve import point_from_config

CONFIG_DIR = str(config_dir())
CONFIG_NAME = "config"
MULTIRUN_FLAGS = ("-m", "--multirun")
# Flags after which Hydra does something other than run points (help, print config, shell completion).
PASS_THROUGH_FLAGS = ("--help", "-h", "--hydra-help", "--version", "--cfg", "-c", "--info", "-i",
                      "--shell-completion", "-sc", "--resolve", "--package", "-p")


@dataclass
class PlannedPoint:
    """One job of the command line, composed, validated and resolved."""

    overrides: tuple[str, ...]  # the job's overrides, as Hydra will hand them to the job
    config: object  # the composed DictConfig
    point: Point  # the resolved point
    does_not_fit: str | None  # a CPU point that cannot fit in free memory: why (a skipped row in a sweep)


@dataclass
class Plan:
    """What a command line will run."""

    multirun: bool  # one process runs several points
    jobs: list[PlannedPoint]  # every point, in Hydra's order


def needs_preflight(argv: list[str]) -> bool:
    return not any(arg.split("=", 1)[0] in PASS_THROUGH_FLAGS for arg in argv)


def plan(argv: list[str], cuda_available) -> Plan:
    """Expand and validate every point of `argv` (the arguments after the program name).

    Raises ConfigError with one line naming the key and what is allowed.
    """
    register_schemas()
    overrides = [arg for arg in argv if not arg.startswith("-")]
    flag_multirun = any(arg in MULTIRUN_FLAGS for arg in argv)
    parser = OverridesParser.create()
    try:
        parsed = parser.parse_overrides(overrides)
    except HydraException as error:
        raise ConfigError("command line", _first_line(error)) from None
    sweeps = [o for o in parsed if o.is_sweep_override()]
    plain = [o.input_line for o in parsed if not o.is_sweep_override()]

    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        base = _compose(plain, with_hydra=True)
        multirun = flag_multirun or str(base.hydra.mode) in ("MULTIRUN", "RunMode.MULTIRUN")
        if sweeps and not multirun:
            raise ConfigError(sweeps[0].get_key_element(), "a list of values is a sweep: add -m (--multirun) to run each")
        sweep_params = base.hydra.sweeper.get("params") if multirun else None
        params = OmegaConf.to_container(sweep_params, resolve=False) if sweep_params else {}
        expanded = parser.parse_overrides([f"{k}={v}" for k, v in params.items()] + overrides)
        job_overrides = BasicSweeper.split_arguments(expanded, max_batch_size=None)[0]
        jobs = []
        for job in job_overrides:
            cfg = _compose(job, with_hydra=False)
            validate_run(cfg, cuda_available)
            point = point_from_config(cfg)
            does_not_fit = shortfall(point) if point.device == "cpu" else None
            jobs.append(PlannedPoint(tuple(job), cfg, point, does_not_fit))
    if not multirun and does_not_fit is not None:
        raise ConfigError("model", f"{point.label()} {does_not_fit}; choose a smaller model, batch or ctx")
    return Plan(multirun=multirun, jobs=jobs)


def _compose(overrides: list[str], with_hydra: bool):
    try:
        return compose(config_name=CONFIG_NAME, overrides=overrides, return_hydra_config=with_hydra)
    except MissingConfigException as error:
        raise _missing_option(error) from None
    except (HydraException, OmegaConfBaseException) as error:
        raise _composition_error(error) from None


def _missing_option(error: MissingConfigException) -> ConfigError:
    """`model=foo` -> "model: unknown option 'foo', allowed: cpu_small, llama3_8b, ..."."""
    missing = error.missing_cfg_file or ""
    group, _, option = missing.rpartition("/")
    allowed = [o for o in (error.options or []) if not o.endswith("_schema")]
    if group and allowed:
        return ConfigError(group, f"unknown option '{option}', allowed: {', '.join(sorted(allowed))}")
    return ConfigError(group or "config", _first_line(error))


def _composition_error(error: Exception) -> ConfigError:
    """Hydra/OmegaConf composition errors as one line naming the key."""
    cause = error.__cause__ or error
    key = getattr(cause, "full_key", None) or getattr(error, "full_key", None)
    message = _first_line(cause)
    if "is not in struct" in str(cause) or "Could not override" in str(error):
        message = f"unknown key ({_first_line(error)})"
    elif "could not be converted" in message or "Value '" in message:
        message = f"wrong type: {message}"
    return ConfigError(str(key) if key else "config", message)


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__

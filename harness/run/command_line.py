"""The command line's rules, before any point is planned: the flags accepted, the Hydra keys a command
line may set (none moves the output: results_dir alone decides where rows and logs go), the settings a
preset may not change, and the config composed through Hydra's compose API with every composition
error as one line naming the key (harness.run.plan plans the points on top of these)."""
from __future__ import annotations

import re

from hydra import compose
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException, MissingConfigException
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from harness.config.overrides import SCHEMA_SUFFIX, composition_refusal, parsed_overrides, unknown_option
from harness.config.validate import ConfigError, first_line, interpolations_resolve
from harness.run.grouping import GROUP_KEY

CONFIG_NAME = "config"
MULTIRUN_FLAGS = ("-m", "--multirun")
RUN_FLAGS = ("-r", "--run")
# Flags after which Hydra does something other than run points (help, print config, shell completion).
PASS_THROUGH_FLAGS = ("--help", "-h", "--hydra-help", "--version", "--cfg", "-c", "--info", "-i",
                      "--shell-completion", "-sc", "--resolve", "--package", "-p")
VALUE_FLAGS = ("--cfg", "-c", "--package", "-p", "--info", "-i")  # pass-through flags followed by their value
# Hydra keys a command line may set: none of them moves the working directory or the output.
HYDRA_KEYS_ALLOWED = ("hydra.searchpath", "hydra.mode", "hydra.verbose", "hydra/launcher")
LAUNCHER_OPTIONS = "hydra.launcher."  # a chosen launcher's options (OUTPUT_SETTINGS still checked)
GROUPS = ("model", "strategy")  # conf/config.yaml's config groups: each point picks one option of each by name
SEARCH_PATH = "hydra.searchpath"  # where a group's options also are (extra config folders)
# Hydra settings that decide where its files go or where a job runs: a preset may not change them.
OUTPUT_SETTINGS = ("run.dir", "sweep.dir", "sweep.subdir", "job.chdir", "output_subdir",
                   "job_logging.handlers.file.filename", "launcher.submitit_folder", "sweeper._target_")


def check_flags(argv: list[str]) -> None:
    """Flags Hydra would take to compose another config than the one the plan checks are refused."""
    for arg in argv:
        flag = arg.split("=", 1)[0]
        if arg.startswith("-") and flag not in MULTIRUN_FLAGS + RUN_FLAGS + PASS_THROUGH_FLAGS:
            raise ConfigError("command line", f"flag {flag!r} is not accepted (it would run another config than the "
                                              "one checked, or is unknown); allowed: -m, --run, --help, --cfg, --info; "
                                              "extra configs: hydra.searchpath=[file:///abs/folder]")


def hydra_order(argv: list[str]) -> list[str]:
    """A planned command line as Hydra's parser takes it: its flags (-m, --run: none takes a value) before
    its overrides, each kept in its order. `model=tiny -m batch=1,2` is planned as written; Hydra's parser
    would stop at the flag and print its usage."""
    return [arg for arg in argv if arg.startswith("-")] + [arg for arg in argv if not arg.startswith("-")]


def parse_overrides(parser: OverridesParser, overrides: list[str]):
    """The overrides parsed, ConfigError on the first Hydra cannot read or that gives a group a list
    (harness.config.overrides)."""
    return parsed_overrides(parser, overrides, GROUPS, lambda group: group_options(group, overrides),
                            sweeps=True, usage=" (python -m harness.run --cfg job prints the keys)")


def group_options(group: str, overrides: list[str]) -> list[str]:
    """The options of `group` where this command line's search path puts them (Hydra's own listing)."""
    loader = GlobalHydra.instance().config_loader()
    searchpath = [o for o in overrides if o.lstrip("+").split("=", 1)[0] == SEARCH_PATH]
    try:
        return loader.get_group_options(group, config_name=CONFIG_NAME, overrides=searchpath)
    except HydraException:  # the search path itself is bad (its own refusal follows): the shipped options
        return loader.get_group_options(group)


def check_hydra_keys(parsed) -> None:
    """Only the Hydra keys that move nothing may be set (the output goes where results_dir says)."""
    for override in parsed:
        key = override.key_or_group
        if not (key == "hydra" or key.startswith(("hydra.", "hydra/"))):
            continue
        if (key in HYDRA_KEYS_ALLOWED or key.startswith(LAUNCHER_OPTIONS)) and not override.is_sweep_override():
            continue
        raise ConfigError(key, "cannot be set: where rows and Hydra's logs go is decided by results_dir alone "
                               f"(logs under <results_dir>/_hydra/); Hydra keys allowed: {', '.join(HYDRA_KEYS_ALLOWED)}, "
                               f"{LAUNCHER_OPTIONS}*, one value each")


def check_point_options(overrides: list[str]) -> None:
    """A point's overrides: not the runner's own `+group=`, and no schema picked as a preset (a glob() sweep
    over a config group also matches its schema, model_schema, which Hydra would then run as a preset with
    every field missing)."""
    for override in overrides:
        key, _, value = override.lstrip("+~").partition("=")
        if key == GROUP_KEY:
            raise ConfigError(GROUP_KEY, "is how the runner tells a job its group (harness.run.grouping), not a setting")
        if "." not in key and value.endswith(SCHEMA_SUFFIX):
            raise ConfigError(key, f"'{value}' is the group's schema, not a preset; in a glob() sweep exclude it: "
                                   f"{key}='glob(*,exclude=*{SCHEMA_SUFFIX})'")


def output_settings(cfg) -> dict:
    """OUTPUT_SETTINGS of a composed config (with its hydra node), interpolations unresolved, None
    where absent."""
    hydra_node = OmegaConf.to_container(cfg.hydra, resolve=False)
    settings = {}
    for setting in OUTPUT_SETTINGS:
        node = hydra_node
        for part in setting.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        settings[setting] = node
    return settings


_SHIPPED_SETTINGS: dict[tuple[str, ...], dict] = {}  # launcher overrides -> OUTPUT_SETTINGS as shipped


def check_output_settings(composed, launcher: list[str]) -> None:
    """A preset (a `# @package _global_` file, say on hydra.searchpath) may not move the output either:
    each of OUTPUT_SETTINGS must be as conf/config.yaml ships it (with the same launcher chosen)."""
    if tuple(launcher) not in _SHIPPED_SETTINGS:
        _SHIPPED_SETTINGS[tuple(launcher)] = output_settings(compose_config(launcher, with_hydra=True))
    found = output_settings(composed)
    for setting, expected in _SHIPPED_SETTINGS[tuple(launcher)].items():
        if found[setting] != expected:
            raise ConfigError(f"hydra.{setting}", f"changed to {found[setting]!r} (by an override or a preset): "
                                                  "where rows and logs go is decided by results_dir alone")


def compose_config(overrides: list[str], with_hydra: bool):
    try:
        cfg = compose(config_name=CONFIG_NAME, overrides=overrides, return_hydra_config=with_hydra)
    except MissingConfigException as error:
        raise missing_option(error) from None
    except (HydraException, OmegaConfBaseException) as error:
        raise composition_error(error) from None
    except ValueError as error:  # Hydra's answer to a config group a preset sets to null (the command line's: parse_overrides)
        raise ConfigError("config", f"{first_line(error, typed=False)}: a config group takes one of its options by name") from None
    # Every ${...} resolves before a value is read; of Hydra's node, the keys a command line may set
    # (its other fields are filled as a job starts).
    settable = {re.split(r"[./]", key)[1] for key in HYDRA_KEYS_ALLOWED}
    interpolations_resolve(cfg, skip=tuple(f"hydra.{key}" for key in cfg.get("hydra", {}) if key not in settable))
    return cfg


def missing_option(error: MissingConfigException) -> ConfigError:
    """`model=foo` -> "model: unknown option 'foo', allowed: cpu_small, llama3_8b, ..."."""
    missing = error.missing_cfg_file or ""
    group, _, option = missing.rpartition("/")
    if group and error.options:
        return unknown_option(group, option, error.options)
    return ConfigError(group or "config", first_line(error, typed=False))


def composition_error(error: Exception) -> ConfigError:
    """Hydra/OmegaConf composition errors as one line naming the key."""
    cause = error.__cause__ or error
    key = getattr(cause, "full_key", None) or getattr(error, "full_key", None)
    message = first_line(cause, typed=False)
    said = composition_refusal(error, sweeps=True)
    if said:
        return said
    if "is not in struct" in str(cause) or "Could not override" in str(error):
        message = f"unknown key ({first_line(error, typed=False)})"
        named = re.match(r"Could not override '([^']+)'", first_line(error, typed=False))  # a group of no defaults list
        key = key or (named and named.group(1))
    elif "could not be converted" in message or "Value '" in message:
        message = f"wrong type: {message}"
    return ConfigError(str(key) if key else "config", message)

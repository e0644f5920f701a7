"""Every strategy a run can name: the options of the `strategy` config group, each one's class.

The group is read from the shipped configs and from any extra config folders (Hydra's search path:
`hydra.searchpath=[file:///abs/folder]` on a command line, or the folders in $HARNESS_SEARCHPATH,
separated by ':', for tools such as the benchmark suite that compose no command line). So a strategy
added as one Python file and one `strategy/<name>.yaml` in such a folder is known everywhere without
an edit here. A YAML that sets `_target_` is its class's own option and is named as the class (its
`name`); one that extends another option through its defaults list (`defaults: [quantized, _self_]`)
is a variant of that class (harness.run.variants), not a class of its own, and the catalog of classes
leaves it out.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable

import yaml

from harness.config import ConfigError
from harness.config.paths import config_dir
from harness.config.validate import target_class
from strategies.base import Strategy

SEARCHPATH_ENV = "HARNESS_SEARCHPATH"


def extra_config_dirs() -> list[Path]:
    """Config folders named by $HARNESS_SEARCHPATH (file:// prefixes allowed)."""
    value = os.environ.get(SEARCHPATH_ENV, "")
    return [Path(part.removeprefix("file://")) for part in value.split(":") if part]


def strategy_targets(extra_dirs: Iterable[Path] = ()) -> dict[str, str]:
    """Option name -> `_target_` class path of every class's own option, over the shipped configs and
    `extra_dirs` (variants, which extend another option, left out)."""
    targets = {}
    for folder in [config_dir(), *extra_dirs, *extra_config_dirs()]:
        for path in sorted(Path(folder, "strategy").glob("*.yaml")):
            node = yaml.safe_load(path.read_text()) or {}
            if "_target_" in node or not node.get("defaults"):
                targets[path.stem] = node.get("_target_", "")
    return targets


def strategy_class(target: str, option: str = "strategy"):
    """The Strategy subclass a `_target_` names, or ConfigError naming the key."""
    return target_class(f"{option}._target_", target, base=Strategy)


def strategy_catalog(extra_dirs: Iterable[Path] = ()) -> dict:
    """Option name -> Strategy subclass, every option's file name checked against its class's name."""
    catalog = {}
    for option, target in strategy_targets(extra_dirs).items():
        cls = strategy_class(target, f"strategy={option}")
        if cls.name != option:
            raise ConfigError("strategy", f"conf strategy/{option}.yaml names {target}, whose name is {cls.name!r}")
        catalog[option] = cls
    return catalog

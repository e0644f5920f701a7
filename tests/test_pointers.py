"""Every pointer written in the tree names something that exists.

Comments, docstrings, configs and docs point at code: a path (`harness/run/plan.py`, `conf/strategy/`,
`tests/test_checkpoint*.py`), a module or one of its symbols (`harness.store.columns.SCHEMA`,
`harness.run.plan:Plan`), a Markdown link and its anchor (`docs/method.md#timing`). Code that moves
breaks its callers loudly and its pointers silently; this test makes a stale pointer fail as a broken
import does. Placeholders (`conf/strategy/<name>.yaml`) are checked up to the placeholder; globs must
match at least one file.
"""
from __future__ import annotations

import importlib
import inspect
import re
import subprocess
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT

TEXT_SUFFIXES = (".py", ".md", ".yaml", ".toml", ".c", ".h", ".cpp", ".sh")
EXTRA_FILES = (".ci/run",)
ROOTS = ("harness", "strategies", "hydra_plugins", "conf", "tests", "scripts", "docs", ".ci")  # folders a path pointer starts with
PATH = re.compile(r"(?<![\w./$-])((?:%s)/[\w./*<>{}-]*)" % "|".join(re.escape(r) for r in ROOTS))
LINE_SUFFIX = re.compile(r":\d+(?:-\d+)?$")  # `file.py:57-70`: a line range, not part of the path
DOTTED = re.compile(r"(?<![\w./])((?:harness|strategies|hydra_plugins\.harness_sweeper)(?:\.[A-Za-z_]\w*)+)(?::([A-Za-z_][\w.]*))?")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
PLACEHOLDER = re.compile(r"[<{$*]")


def tracked_text_files() -> list[Path]:
    names = subprocess.run(["git", "ls-files"], cwd=REPO_ROOT, capture_output=True, text=True, check=True).stdout.split()
    return [REPO_ROOT / name for name in names
            if (name.endswith(TEXT_SUFFIXES) or name in EXTRA_FILES) and (REPO_ROOT / name).is_file()
            and name != "tests/test_pointers.py"]


def _path_exists(pointer: str) -> bool:
    pointer = LINE_SUFFIX.sub("", pointer.rstrip(".,:;)`'\""))
    if "*" in pointer and not PLACEHOLDER.search(pointer.replace("*", "")):
        return any(REPO_ROOT.glob(pointer))
    if (cut := PLACEHOLDER.search(pointer)) is not None:
        pointer = pointer[: cut.start()].rsplit("/", 1)[0]  # the folder the placeholder lives in
    return (REPO_ROOT / pointer).exists()


def _symbol_exists(dotted: str, attribute: str | None) -> bool:
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        module_name = ".".join(parts[:cut])
        try:
            target = importlib.import_module(module_name)
        except ModuleNotFoundError as error:
            if error.name is not None and not module_name.startswith(error.name):
                raise  # the module exists but imports something missing: a real failure, not a stale pointer
            continue
        for name in parts[cut:]:
            if not _has(target, name):
                return False
            target = getattr(target, name, None)
        if not attribute or not inspect.ismodule(target):
            return True  # `Class:backend` (a point's reference) is a class and an option, not a symbol
        for name in attribute.split("."):
            if not _has(target, name):
                return False
            target = getattr(target, name, None)
        return True
    return False


def _has(target, name: str) -> bool:
    """An attribute, or a class's declared one (`name: ClassVar[str]` has no value on the base class)."""
    return hasattr(target, name) or name in getattr(target, "__annotations__", {})


def _anchors(markdown: Path) -> set[str]:
    """GitHub's heading anchors: lowercase, punctuation dropped, spaces to hyphens."""
    found = set()
    for line in markdown.read_text().splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            found.add(re.sub(r"\s", "-", re.sub(r"[^\w\s-]", "", title)))
    return found


def _stale_pointers(file: Path) -> list[str]:
    text = file.read_text(errors="replace")
    where = file.relative_to(REPO_ROOT)
    stale = [f"{where}: path {p}" for p in PATH.findall(text) if not _path_exists(p)]
    stale += [f"{where}: symbol {d}{':' + a if a else ''}" for d, a in DOTTED.findall(text) if not _symbol_exists(d, a)]
    if file.suffix == ".md":
        for target in LINK.findall(text):
            if target.startswith(("http://", "https://", "mailto:")):
                continue
            path, _, anchor = target.partition("#")
            linked = (file.parent / path).resolve() if path else file
            if not linked.exists():
                stale.append(f"{where}: link {target}")
            elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked):
                stale.append(f"{where}: anchor {target}")
    return stale


def test_every_pointer_names_something_that_exists():
    stale = sorted({entry for file in tracked_text_files() for entry in _stale_pointers(file)})
    assert not stale, f"{len(stale)} stale pointer(s):\n" + "\n".join(stale)


@pytest.mark.parametrize("pointer, exists", [
    ("harness/run/plan.py", True), ("harness/run/plan.py:57-70", True), ("harness/run/nothing.py", False),
    ("conf/strategy/<name>.yaml", True), ("tests/test_checkpoint*.py", True), ("strategies/cpu_*.c", False),
])
def test_the_path_rule_tells_a_stale_path(pointer, exists):
    assert _path_exists(pointer) is exists


@pytest.mark.parametrize("dotted, attribute, exists", [
    ("harness.run.plan", None, True), ("harness.run.plan.Plan", None, True), ("harness.run.plan", "Plan", True),
    ("harness.run.plan.measure_point", None, False), ("harness.measure.point", None, False),
    ("strategies.base.Strategy.name", None, True), ("strategies.caches.contiguous.ContiguousStrategy", "sdpa", True),
])
def test_the_symbol_rule_tells_a_stale_symbol(dotted, attribute, exists):
    assert _symbol_exists(dotted, attribute) is exists

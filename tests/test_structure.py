"""The structure the pipeline promises: no import cycles, and no strategy known by its name outside
strategies/ (capabilities are read from the class or the row, never guessed from a name). The layers
themselves are checked by import-linter (`lint-imports`, pyproject.toml), which CI runs."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT, STRATEGIES

grimp = pytest.importorskip("grimp", reason="grimp comes with import-linter (the test extra)")


def test_no_module_imports_itself_through_others():
    graph = grimp.build_graph("harness", "strategies")
    cycles = []
    for module in sorted(graph.modules):
        for imported in graph.find_modules_directly_imported_by(module):
            if graph.chain_exists(importer=imported, imported=module):
                cycles.append(" -> ".join(graph.find_shortest_chain(importer=imported, imported=module)) + f" -> {imported}")
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def _string_literals(path: Path) -> list[tuple[int, str]]:
    """String constants of a module that are not docstrings (a docstring may name a strategy)."""
    tree = ast.parse(path.read_text())
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    return [(node.lineno, node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings]


def test_no_strategy_name_is_spelled_outside_strategies():
    """A strategy added as one file and one YAML must appear everywhere: so no code under harness/
    compares, looks up or orders by a strategy's name (one place, the benchmark suite's prefill, uses
    the contiguous class by import, not by name)."""
    names = set(STRATEGIES)
    found = [f"{path.relative_to(REPO_ROOT)}:{line}: {value!r}"
             for path in sorted((REPO_ROOT / "harness").rglob("*.py"))
             for line, value in _string_literals(path) if value in names]
    assert not found, "strategy names in harness code:\n" + "\n".join(found)


def _policy_names_spelled(path: Path, names: set[str]) -> list[tuple[int, str]]:
    """String constants of a module equal to an eviction policy's name, leaving out docstrings and the
    one place a name belongs: a class body's `name = "..."` (the policy declaring its own name)."""
    tree = ast.parse(path.read_text())
    declared = {(statement.value.lineno, statement.value.value) for node in ast.walk(tree)
                if isinstance(node, ast.ClassDef) for statement in node.body
                if isinstance(statement, ast.Assign) and isinstance(statement.value, ast.Constant)
                and [getattr(target, "id", None) for target in statement.targets] == ["name"]}
    return [(line, value) for line, value in _string_literals(path) if value in names and (line, value) not in declared]


def test_no_eviction_policy_is_known_by_its_name(tmp_path):
    """A policy added as one class and one YAML must work everywhere: no code under harness/ or
    strategies/ compares, looks up or orders by a policy's name; the policy's class declares what it
    does (strategies.caches.eviction_policies), and its own `name` is the one place the name is spelled."""
    from strategies.caches.eviction_policies import EvictionPolicy

    names = set(EvictionPolicy.registered)
    assert {"streaming", "h2o", "snapkv", "tova"} <= names
    found = [f"{path.relative_to(REPO_ROOT)}:{line}: {value!r}"
             for package in ("harness", "strategies") for path in sorted((REPO_ROOT / package).rglob("*.py"))
             for line, value in _policy_names_spelled(path, names)]
    assert not found, "eviction policy names in code:\n" + "\n".join(found)
    planted = tmp_path / "planted.py"  # the check sees a comparison, and lets a declaration be
    planted.write_text('class P:\n    name = "h2o"\n\n\ndef f(policy):\n    return policy.name == "h2o"\n')
    assert _policy_names_spelled(planted, names) == [(6, "h2o")]

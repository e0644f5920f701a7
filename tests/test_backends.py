"""One backend rule for every strategy (strategies/backends.py): backends declared as data in preference
order, `auto` the first whose needs hold, a named one that cannot run a skipped row with the reason,
the choice made once when a point is planned and run by its sessions; and every row's `backend` and
`kernel` columns pinned for every strategy, option, backend, dtype and shape class
(tests/fixtures/backend_columns.json, with the C kernels built and without them), device=cpu."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from harness.config import ConfigError
from harness.kernels import extension
from harness.run.catalog import strategy_catalog
from strategies import StrategyUnavailable, backends
from strategies.backends import Backend
from strategies.base import CachedSession, Strategy
from tests.conftest import TINY, cpu_model, planned_point

CPU = torch.device("cpu")
COLUMNS = Path(__file__).parent / "fixtures" / "backend_columns.json"
# Each strategy's options worth telling apart (a kernel name carries the format; flash_attn pages 256).
OPTIONS = {"paged": [[], ["strategy.block_size=256"]],
           "quantized": [[], ["strategy.format=int4", "strategy.group_size=4"],
                         ["strategy.format=fp8_e4m3", "strategy.key_axis=channel", "strategy.residual=16"]]}
# tiny, and a group of 64 query heads per KV head: beyond the C kernels' limit of 32.
SHAPES = {"tiny": ["model=tiny"], "group64": ["model=tiny", "model.d_model=256", "model.n_heads=64", "model.n_kv_heads=1"]}


def columns() -> dict[str, list]:
    """Every strategy x its options x backend x dtype x shape: [the point's `backend`, the member's
    `kernel` (None: a skipped row)], or ["refused", the line] where the plan refuses the point."""
    table = {}
    for name, cls in sorted(strategy_catalog().items()):
        for options in OPTIONS.get(name, [[]]):
            for backend in ("auto", *cls.backend_names()):
                for dtype in ("float32", "bfloat16"):
                    for shape, shape_args in SHAPES.items():
                        case = " ".join([name, *options, f"backend={backend}", dtype, shape])
                        table[case] = point_columns(name, backend, dtype, [*shape_args, *options])
    return table


def point_columns(name: str, backend: str, dtype: str, overrides: list[str]) -> list:
    try:
        point = planned_point(f"strategy={name}", f"strategy.backend={backend}", f"dtype={dtype}", *overrides)
    except ConfigError as refused:
        return ["refused", str(refused)]
    try:
        kernel = point.strategy.instantiate().kernel(CPU, getattr(torch, dtype), point.model)
    except StrategyUnavailable as unavailable:
        assert str(unavailable) and "\n" not in str(unavailable)  # the skipped row's reason: one line
        kernel = None
    return [point.strategy.backend, kernel]


@pytest.mark.slow  # ~400 plans through Hydra (20 s a state); the rule itself: the Toy tests below
@pytest.mark.parametrize("state", ["built", "without"])
def test_every_rows_backend_and_kernel_columns_are_as_before(state, monkeypatch):
    if state == "built" and extension.EXTENSION.unavailable() is not None:
        pytest.skip(f"the C kernels cannot be built here: {extension.EXTENSION.unavailable()}")
    if state == "without":
        monkeypatch.setitem(extension.EXTENSION.__dict__, "_loaded", "no C++ compiler (false) on PATH")
    expected = json.loads(COLUMNS.read_text())[state]
    got = columns()
    assert got.keys() == expected.keys()
    assert {case: got[case] for case in got if got[case] != expected[case]} == {}


def plain(strategy: Strategy, device: torch.device) -> str | None:
    return None


class Toy(Strategy):
    """Three backends: one that needs bfloat16, one that needs a package nobody has, one with no needs."""

    name = "toy"
    backends = (Backend("wide", "wide kernel", dtypes=("bfloat16",)),
                Backend("packaged", "packaged kernel", package="no_such_package_here", extra="toy"),
                Backend("plain", "plain kernel for {flavour}", condition=plain))

    def __init__(self, backend: str = "auto", flavour: str = "vanilla"):
        super().__init__(backend)
        self.flavour = flavour

    def options(self) -> dict:
        return {"flavour": self.flavour}

    def new_session(self, model, batch: int, max_len: int) -> CachedSession:
        raise NotImplementedError


def test_auto_is_the_first_backend_whose_needs_hold():
    assert Toy().resolve_backend(CPU, torch.bfloat16) == "wide"
    assert Toy().resolve_backend(CPU, torch.float32) == "plain"
    assert Toy().kernel(CPU, torch.float32) == "plain kernel for vanilla"  # {option}s filled from options()


def test_a_named_backend_that_cannot_run_is_unavailable_with_its_reason():
    with pytest.raises(StrategyUnavailable, match=r"^wide runs in bfloat16; dtype is float32$"):
        Toy(backend="wide").kernel(CPU, torch.float32)
    with pytest.raises(StrategyUnavailable, match=r"^no_such_package_here is not importable .*pip install -e '\.\[toy\]'$"):
        Toy(backend="packaged").resolve_backend(CPU, torch.bfloat16)


def test_auto_with_no_backend_that_can_run_names_every_reason():
    class Picky(Toy):
        backends = Toy.backends[:2]

    with pytest.raises(StrategyUnavailable, match=r"^wide: wide runs in bfloat16; .*; packaged: no_such_package_here"):
        Picky().kernel(CPU, torch.float32)


def test_a_planned_point_is_chosen_once_and_its_sessions_never_choose(monkeypatch):
    """The plan resolves `auto` into the point; the strategy built for the point names that backend,
    and a session of it runs it without calling the rule again."""
    point = planned_point("model=tiny", "strategy=contiguous", "matmul=aten")
    chosen = point.strategy.backend
    assert chosen in ("c", "sdpa")
    strategy = point.strategy.instantiate()
    assert strategy.backend == chosen

    def no_choice(*args, **kwargs):
        raise AssertionError("a session chose its backend again")

    monkeypatch.setattr(backends, "choose", no_choice)
    monkeypatch.setattr("strategies.base.choose", no_choice)
    session = strategy.new_session(cpu_model(TINY, matmul="aten"), 1, 8)
    kernel = session.layer_caches[0].decode_kernel
    assert (kernel is not None) == (chosen == "c")


def test_what_a_strategy_declares_is_what_backend_may_name_and_what_the_readme_lists():
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    for name, cls in strategy_catalog().items():
        names = cls.backend_names()
        assert len(set(names)) == len(names)
        entry = next((line for line in readme.splitlines() if line.startswith(f"- `{name}`:")), "")
        if "backends" in entry:  # the README's strategy list names each one's backends
            assert [backend for backend in names if f"`{backend}`" not in entry] == [], entry

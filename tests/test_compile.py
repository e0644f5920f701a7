"""compile=inductor: the decode step through torch.compile generates the eager step's tokens, compiles
before timing and not again per position, and a strategy that cannot be compiled is a skipped row."""
from __future__ import annotations

import dataclasses
import shutil

import pytest

from harness.config import ConfigError
from harness.measure.group import measure_point
from tests.conftest import planned_point

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="inductor's CPU backend needs a C++ compiler")

TINY_POINT = ("model=tiny", "ctx=24", "decode_tokens=6", "timing.warmup_max=3")


@pytest.mark.slow
@pytest.mark.parametrize("strategy,backend", [("contiguous", "c"), ("contiguous", "sdpa"), ("static_full", "c")])
def test_compiled_steps_generate_the_eager_tokens(strategy, backend):
    """Both attention kernels of contiguous: the C one enters the graph as a custom op, SDPA as itself;
    and static_full, whose fixed shapes are what compilation wants, its masked read the same custom op."""
    eager = planned_point(*TINY_POINT, f"strategy={strategy}", f"strategy.backend={backend}")
    compiled = dataclasses.replace(eager, compile="inductor")
    eager_row, compiled_row = measure_point(eager), measure_point(compiled)
    assert eager_row["status"] == compiled_row["status"] == "ok", compiled_row["reason"]
    assert compiled_row["tokens_digest"] == eager_row["tokens_digest"]
    assert compiled_row["compile_s"] > 0 and eager_row["compile_s"] is None
    # Positions ctx and ctx + 1 were compiled before timing: the C kernel's graph never recompiles; SDPA's
    # slice of the filled prefix compiled once more during the 6 timed steps here (counted in the row),
    # never once per position.
    assert compiled_row["compile_recompiles"] == 0 if backend == "c" else compiled_row["compile_recompiles"] <= 1
    assert "torch.compile(" in compiled_row["compile_mode"] and eager_row["compile_mode"] == "eager"


def test_a_strategy_that_is_not_compilable_is_a_skipped_row():
    point = dataclasses.replace(planned_point(*TINY_POINT, "strategy=paged"), compile="inductor")
    row = measure_point(point)
    assert row["status"] == "skipped" and "compilable" in row["reason"]


def test_compile_is_a_point_key_and_refuses_unknown_modes():
    eager = planned_point(*TINY_POINT)
    compiled = planned_point(*TINY_POINT, "compile=inductor")
    assert (eager.compile, compiled.compile) == ("none", "inductor") and eager.key != compiled.key
    with pytest.raises(ConfigError, match="compile"):
        planned_point(*TINY_POINT, "compile=eager")

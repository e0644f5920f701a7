"""hugepages=true: a point's CPU tensors on 2 MiB pages, asked for in its own process and measured there."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pandas as pd
import pytest

from harness.analysis.results import SERIES, add_series
from harness.measure.group import measure_point
from harness.run.isolation import run_isolated
from harness.run.row import build_row
from tests.conftest import planned_point, run_cli

THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")
# A point whose K and V tables are 4 MiB each (tiny: 2 KV heads of 16; batch 8 x 4096 positions), so
# each spans whole 2 MiB pages.
POINT = ("model=tiny", "strategy=contiguous", "batch=8", "ctx=4092", "decode_tokens=4", "timing.warmup_max=2",
         "prefill=random")


def thp_available() -> bool:
    """Transparent huge pages can be had by madvise (the setting is `always` or `madvise`)."""
    try:
        return "[never]" not in THP_SETTING.read_text()
    except OSError:
        return False


@pytest.mark.skipif(not thp_available(), reason="transparent huge pages are off or not Linux's")
def test_a_point_asked_for_hugepages_runs_on_them_and_says_so():
    default = planned_point(*POINT)
    asked = dataclasses.replace(default, hugepages=True)
    rows = {name: run_isolated(measure_point, point) for name, point in (("default", default), ("asked", asked))}
    assert rows["default"]["status"] == rows["asked"]["status"] == "ok", rows
    assert rows["asked"]["anon_hugepages_bytes"] >= 2 << 20  # at least one 2 MiB page of the table
    assert rows["asked"]["anon_hugepages_bytes"] > rows["default"]["anon_hugepages_bytes"]
    assert rows["asked"]["tokens_digest"] == rows["default"]["tokens_digest"]  # the pages change no result
    row = build_row(asked, rows["asked"])  # the row says what was asked and what ran
    assert row["hugepages"] is True and row["anon_hugepages_bytes"] == rows["asked"]["anon_hugepages_bytes"]


def test_the_default_leaves_point_keys_as_they_were():
    default = planned_point(*POINT)
    assert "hugepages" not in default.identity()
    assert planned_point(*POINT, "hugepages=true").key != default.key


def test_hugepages_without_isolation_is_refused_by_the_plan(results_dir):
    from harness.config import ConfigError
    from harness.run.plan import plan

    with pytest.raises(ConfigError, match="^hugepages: .*isolate=true"):
        plan(["model=tiny", "device=cpu", "isolate=false", "hugepages=true", f"results_dir={results_dir}"],
             cuda_available=lambda: False)


@pytest.mark.slow  # through the CLI; the plan's refusal: the test above
def test_hugepages_without_isolation_is_refused(results_dir):
    done = run_cli("model=tiny", "device=cpu", "isolate=false", "hugepages=true", f"results_dir={results_dir}",
                   timeout=120)
    assert done.returncode != 0
    assert "hugepages" in done.stderr and "isolate=true" in done.stderr and "Traceback" not in done.stderr
    assert not results_dir.exists() or not list(results_dir.glob("*.parquet"))


def test_a_sweep_over_page_sizes_draws_each_layout_on_each():
    rows = pd.DataFrame({"strategy": ["paged", "paged", "contiguous", "contiguous"],
                         "strategy_options": ['{"block_size": 16}'] * 2 + ["{}"] * 2,
                         "hugepages": [True, False, None, None]})  # None: a row written before the column
    assert list(add_series(rows)[SERIES]) == ["paged[hugepages=True]", "paged[hugepages=False]", "contiguous",
                                              "contiguous"]

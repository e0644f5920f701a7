"""`+sweep=capacity` (search=max_batch): the largest batch that runs within memory_limit_bytes, measured.

The bisection's guarantee is read back from the rows it wrote: the answer's row is ok with its
measured peak within the limit, and the row of one batch more exceeds it (or did not run). The paper
answers beside it come from the memory model and the capacity plan. Bad combinations are refused in
one line before anything runs.
"""
from __future__ import annotations

import re

import pandas as pd
import pytest

from tests.conftest import refused_by_runner
from tests.hardening_helpers import cli, only_line, seeded

LIMIT = 300_000_000
SEARCH = ["+sweep=capacity", "device=cpu", f"memory_limit_bytes={LIMIT}", "ctx=256", "decode_tokens=2",
          "isolate=false"]


@pytest.mark.slow
def test_the_search_finds_the_largest_batch_within_the_limit(tmp_path):
    result = cli(*SEARCH, f"results_dir={seeded(tmp_path)}", timeout=600)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    found = re.search(r"measured (\d+); memory model \(weights \+ cache \+ transients\) (\d+); "
                      r"capacity plan \(weights \+ cache\) (\d+)", output)
    assert found, output
    largest, model, plan = map(int, found.groups())
    rows = pd.read_parquet(tmp_path).set_index("batch")
    assert (rows.memory_limit_bytes == LIMIT).all() and rows.index.is_unique
    assert rows.loc[largest, "status"] == "ok" and rows.loc[largest, "peak_memory_bytes"] <= LIMIT
    above = rows.loc[largest + 1]
    assert above.status != "ok" or above.peak_memory_bytes > LIMIT
    assert len(rows) <= 2 * max(largest, model).bit_length() + 2  # a bisection, not a scan
    assert (rows.peak_memory_predicted_bytes > rows.weight_bytes).all() and model >= 1 and plan >= model


@pytest.mark.parametrize("fits_up_to", [0, 1, 37, 300])
def test_the_search_finds_the_largest_batch_in_about_log2_probes(tmp_path, fits_up_to):
    """The fast tier's form of the test above: the search itself, with a planted measurer whose rows'
    peaks fit the limit up to `fits_up_to` sequences and exceed it beyond."""
    from harness.run import capacity_search
    from harness.run.plan import plan
    from harness.run.row import build_row
    from harness.store.files import write_row

    planned = plan([*SEARCH, f"results_dir={seeded(tmp_path)}"], cuda_available=lambda: False).planned[0]
    asked = []

    def planted_measure(cfg, probe):
        asked.append(probe.point.batch)
        peak = LIMIT // 2 if probe.point.batch <= fits_up_to else LIMIT + 1
        write_row(tmp_path, build_row(probe.point, {"status": "ok", "reason": "planted", "peak_memory_bytes": peak}))

    probed, largest = capacity_search.search(planned.config, planned, planted_measure)
    assert largest == (fits_up_to or None)
    assert [point.batch for point in probed] == asked and len(set(asked)) == len(asked)  # no batch probed twice
    assert len(asked) <= 2 * max(fits_up_to, capacity_search.model_max_batch(planned.point)).bit_length() + 2
    line = capacity_search.answer_line(planned.point, largest)
    assert f"measured {fits_up_to or 'none (not even 1)'};" in line and "memory model" in line


@pytest.mark.parametrize("extra, key", [
    (["memory_limit_bytes=null"], "memory_limit_bytes"),
    (["memory_limit_bytes=-5"], "memory_limit_bytes"),
    (["search=max_pages"], "search"),
])
def test_a_search_without_a_sensible_limit_is_refused(tmp_path, extra, key):
    assert refused_by_runner(*SEARCH, *extra, f"results_dir={tmp_path}").startswith(f"error: {key}: ")
    assert not tmp_path.exists() or not list(tmp_path.glob("*.parquet"))


def test_every_bad_search_is_refused_by_the_plan(tmp_path):
    """The refusals above and below, in process (the CLI's exit 2 and one line: the tests around)."""
    from harness.config import ConfigError
    from harness.run.plan import plan

    for extra, key in ((["memory_limit_bytes=-5"], "memory_limit_bytes"), (["search=max_pages"], "search"),
                       (["-m", "strategy=contiguous,paged"], "search")):
        with pytest.raises(ConfigError) as refused:
            plan([*SEARCH, *extra, f"results_dir={tmp_path}"], cuda_available=lambda: False)
        assert str(refused.value).startswith(f"{key}: "), (extra, str(refused.value))


@pytest.mark.slow  # through the CLI; the plan's refusal: test_every_bad_search_is_refused_by_the_plan
def test_a_search_over_a_sweep_is_refused(tmp_path):
    result = cli("-m", *SEARCH, "strategy=contiguous,paged", f"results_dir={tmp_path}")
    assert result.returncode == 2 and only_line(result.stderr).startswith("error: search: ")

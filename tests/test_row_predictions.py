"""Predictions made once, in the row, and rows of an older schema brought up to date on read.

tests/fixtures/rows_schema0/ holds two rows written by the harness before schema_version existed
(`python -m harness.run -m model=tiny strategy=contiguous,no_cache batch=1 ctx=16 decode_tokens=4
device=cpu`, on a contended machine: their steps are far above the roof): they must load, be predicted
at the roofs they recorded, and report.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import pandas as pd
import pyarrow.parquet as pq
import pytest

from harness.analysis import analytic
from harness.analysis.predictions import predict
from harness.analysis.results import Results, load
from harness.store.recorded import layout_of, shape_of
from harness.store.columns import COLUMN_NAMES, SCHEMA_VERSION
from harness.store.upgrade import upgrade
from tests.report_fixtures import CPU_ROOF, DECODE_TOKENS, DTYPE, SHAPE, INT8, row, write_results

OLD_ROWS = Path(__file__).parent / "fixtures" / "rows_schema0"


def test_the_run_writes_every_prediction_from_the_one_definition():
    written = row("quantized", 4, 256)
    written.update(roof_bandwidth_Bps=CPU_ROOF.bytes_per_s, roof_flops=CPU_ROOF.flops_per_s)
    from harness.run.row import build_row, roof_columns
    from tests.report_fixtures import point
    where = point("quantized", 4, 256)

    class Roofs:  # a calibration record's three roofs
        read_bandwidth_Bps, matmul_flops, gemv_bandwidth_Bps = CPU_ROOF.bytes_per_s, CPU_ROOF.flops_per_s, None

    columns = roof_columns(where, written, Roofs())
    step = analytic.mean_decode_step(SHAPE, DTYPE, 4, 256, DECODE_TOKENS, INT8, CPU_ROOF)
    assert columns["predicted_step_s"] == pytest.approx(step.seconds)
    assert columns["predicted_prefill_s"] == pytest.approx(analytic.prefill_time(SHAPE, DTYPE, 4, 256, CPU_ROOF, INT8))
    assert columns["roofline_fraction"] == pytest.approx(step.seconds / written["decode_step_s"])
    built = build_row(where, {"status": "ok", "decode_step_s": 1e-3}, roofs=Roofs())
    assert built["schema_version"] == SCHEMA_VERSION and list(built) == COLUMN_NAMES
    assert built["kv_bytes_per_token_held"] == pytest.approx(
        analytic.kv_bytes_per_token_held(SHAPE, DTYPE, 256 + DECODE_TOKENS, INT8))
    assert built["predicted_step_s"] == pytest.approx(step.seconds)


def test_a_row_without_a_cache_holds_no_bytes_per_token():
    assert predict(SHAPE, DTYPE, 1, 64, 8, None)["kv_bytes_per_token_held"] is None


def test_rows_of_schema_version_0_load_with_their_predictions_at_the_roofs_they_recorded():
    table = load(OLD_ROWS)
    assert "schema_version" not in pq.read_schema(next(OLD_ROWS.glob("*.parquet"))).names  # truly old
    assert len(table) == 2 and set(table["schema_version"]) == {SCHEMA_VERSION}
    assert set(COLUMN_NAMES) <= set(table.columns)
    for _, r in table.iterrows():
        roof = analytic.Roof(float(r["roof_flops"]), float(r["roof_bandwidth_Bps"]))
        expected = predict(shape_of(r), r["dtype"], int(r["batch"]), int(r["ctx"]), int(r["decode_tokens"]),
                           layout_of(r), roof)
        assert r["predicted_step_s"] == pytest.approx(expected["predicted_step_s"])
        assert r["predicted_prefill_s"] == pytest.approx(expected["predicted_prefill_s"])
        assert r["roof_source"] == "measured"
        assert r["ratio_decode_step_s"] == pytest.approx(r["decode_step_s"] / r["predicted_step_s"])
    assert bool(table["hugepages"].eq(False).all()) and set(table["compile"]) == {"none"}


def test_rows_of_schema_version_0_report(tmp_path):
    from harness.report.assemble import build_report
    folder = tmp_path / "old"
    shutil.copytree(OLD_ROWS, folder)
    files = build_report(folder)
    text = Path(files.markdown).read_text()
    assert "contiguous" in text and "no_cache" in text


def test_the_upgrader_adds_every_column_of_today_typed():
    old = pd.DataFrame({"strategy": ["paged"], "batch": [1]})
    new = upgrade(old)
    assert set(COLUMN_NAMES) <= set(new.columns)
    assert new["strategy_family"].iloc[0] == "paged" and str(new["cache_block_size"].dtype) == "Int64"
    assert "strategy_family" not in old  # a copy


def test_rows_before_the_fitted_threads_ran_every_step_at_their_threads():
    """Version 3 rows: a cache's timed steps ran none at fewer threads; an engine's (its own pool) and a
    row that timed nothing say nothing."""
    old = pd.DataFrame({"schema_version": [3, 3, 3], "decode_step_s": [0.02, 0.02, None],
                        "engine": [None, "llama.cpp", None]})
    new = upgrade(old)
    assert list(new["decode_steps_fewer_threads"].astype(object).where(new["decode_steps_fewer_threads"].notna(),
                                                                       None)) == [0, None, None]
    assert list(new["timing_adapt_threads"]) == [False] * 3


def test_a_row_read_twice_counts_once_and_says_so(tmp_path):
    folder = write_results(tmp_path / "r", awkward=False, batches=(1,), contexts=(64,), row_roofs=True)
    first = next(folder.glob("contiguous*.parquet"))
    shutil.copy(first, folder / f"copy-{first.name}")
    table = load(folder)
    assert len(table) == 2
    (key, files), = table.attrs["duplicates"]
    assert len(files) == 2 and key == "contiguous-1-64"
    both = load([folder, folder])
    assert len(both) == 2 and len(both.attrs["duplicates"]) == 2


def test_a_datasheet_predicts_every_row_again(tmp_path):
    folder = write_results(tmp_path / "r", awkward=False, batches=(1,), contexts=(64,), row_roofs=True)
    own, again = load(folder), load(folder, datasheet="h100_sxm")
    assert set(own["roof_source"]) == {"measured"} and set(again["roof_source"]) == {"datasheet"}
    assert (again["predicted_step_s"] < own["predicted_step_s"]).all()  # an H100 beside a 2-core CPU
    assert (again["bytes_per_step_model"] == own["bytes_per_step_model"]).all()  # roof-free: the row's own


def test_the_report_names_rows_read_twice_and_the_baselines_unread_files(tmp_path):
    from harness.report.assemble import build_report
    folder = write_results(tmp_path / "r", awkward=False, batches=(1,), contexts=(64,), row_roofs=True)
    first = next(folder.glob("contiguous*.parquet"))
    shutil.copy(first, folder / f"copy-{first.name}")
    baseline = write_results(tmp_path / "b", batches=(1,), contexts=(64,), row_roofs=True)  # awkward: a corrupt file
    text = Path(build_report(folder, baseline=baseline).markdown).read_text()
    assert "Rows read more than once, counted once" in text and f"copy-{first.name}" in text
    assert "of the baseline folder are not rows" in text and "corrupt.parquet" in text


def test_suggested_commands_name_a_checkpoint_by_its_file_not_as_a_preset(tmp_path):
    from harness.report.cohorts import cohorts_of
    folder = write_results(tmp_path / "r", awkward=False, batches=(1,), contexts=(64,), row_roofs=True)
    table = load(folder)
    assert cohorts_of(Results.of(table))[0].model_key == "model=cpu_small"  # a preset
    table["model"], table["checkpoint"] = "SmolLM2-135M-Instruct.Q4_1", "/models/SmolLM2-135M-Instruct.Q4_1.gguf"
    assert cohorts_of(Results.of(table))[0].model_key == "model.checkpoint=/models/SmolLM2-135M-Instruct.Q4_1.gguf"


def test_reading_many_one_row_files_is_not_a_pandas_read_per_file(tmp_path):
    """A folder of thousands of one-row files (a large sweep) reads as one Arrow table, converted to
    pandas once. Timed against reading each file into pandas on its own and joining them (what the
    loader did: 5,000 files took 123 s), alternately, best of three, so a busy machine slows both
    alike: the loader, predictions included, takes well under that read alone (about 0.4x here)."""
    import time

    import pyarrow as pa

    from harness.store.files import row_table
    n = 150  # files: the costs compared are per file, so a few hundred tell them apart
    table = pa.concat_tables([row_table(row("contiguous", 1, 64))] * n)
    table = table.set_column(table.column_names.index("point_key"), "point_key", pa.array([f"k{i}" for i in range(n)]))
    for i in range(n):
        pq.write_table(table.slice(i, 1), tmp_path / f"r{i:04d}.parquet")
    paths = sorted(tmp_path.glob("*.parquet"))

    def one_at_a_time():
        return pd.concat([pq.read_table(path).to_pandas() for path in paths], ignore_index=True)

    best = {one_at_a_time: float("inf"), load: float("inf")}
    for _ in range(3):
        for read in best:
            start = time.perf_counter()
            assert len(read(tmp_path) if read is load else read()) == n
            best[read] = min(best[read], time.perf_counter() - start)
    assert best[load] < 0.75 * best[one_at_a_time], best


def test_a_run_whose_rows_were_all_noisy_does_not_say_nothing_was_timed_together(tmp_path):
    """Members timed in one group's rounds, every row flagged noisy: their paired ratios are kept, marked
    (tests/test_report_noisy.py checks each place they appear)."""
    from harness.report.assemble import build_report
    from tests.report_fixtures import write_variant_results
    folder = write_variant_results(tmp_path / "r", batches=(1,), contexts=(256,), noisy=lambda *point: True)
    text = Path(build_report(folder).markdown).read_text()
    assert "No two strategies were timed in the same rounds here" not in text
    assert "ratio(s) draw on noisy rows" in text and "**Kept**, marked `noisy`" in text


"""The report as a reader of folders it did not write: a readable file of the wrong shape is skipped and
named as an unreadable one is; one odd row costs its own line, not the report; the report removes only
files it wrote, and only once its new files are whole; it refuses an `out=` where its files would be read
as rows. Each case is one line of a table.
"""
from __future__ import annotations

import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from harness.analysis import results as loader
from harness.report import assemble
from harness.report.assemble import ReportError, build_report
from harness.report.guard import NOT_DRAWN
from harness.report.outputs import MANIFEST
from harness.store.files import write_row
from tests.hardening_helpers import cli, only_line
from tests.report_fixtures import CPU_ROOF, row, write_results

GOOD_ROWS = 8  # no_cache and contiguous at batch 1, 4 and ctx 64, 256


def good_folder(tmp_path) -> Path:
    return write_results(tmp_path / "results", awkward=False, batches=(1, 4), contexts=(64, 256), row_roofs=True)


def planted_file(folder: Path, column: str, values: pa.Array, name: str = "planted.parquet") -> Path:
    """A copy of one good row file with `column` replaced (or added) by `values`: readable, of another shape."""
    table = pq.read_table(next(folder.glob("contiguous*.parquet")))
    table = table.set_column(table.schema.get_field_index("point_key"), "point_key", pa.array([name]))
    index = table.schema.get_field_index(column)
    table = table.set_column(index, column, values) if index >= 0 else table.append_column(column, values)
    pq.write_table(table, folder / name)
    return folder / name


# A column of another type than a row's: (column, the planted values, the words of the reason)
WRONG_SHAPES = {
    "batch as text": ("batch", pa.array(["4"]), "column batch is string, a row's is int64"),
    "status as a number": ("status", pa.array([1]), "column status is int64, a row's is string"),
    "reason as a struct": ("reason", pa.array([{"why": "x"}]), "column reason is struct"),
    "schema_version as text": ("schema_version", pa.array(["1"]), "column schema_version is string"),
    "ctx with a fraction": ("ctx", pa.array([1.5]), "column ctx does not read as int64"),
    "exact as a number": ("exact", pa.array([1]), "column exact is int64, a row's is bool"),
    "step times as text": ("decode_step_times_s", pa.array(["0.1,0.2"]), "column decode_step_times_s is string"),
    "timestamp as text": ("timestamp", pa.array(["2026-01-01"]), "column timestamp is string"),
    "step time as text": ("decode_step_s", pa.array(["fast"]), "column decode_step_s is string"),
}


@pytest.mark.parametrize("case", WRONG_SHAPES)
def test_a_readable_file_of_the_wrong_shape_is_skipped_and_named(tmp_path, case):
    column, values, reason = WRONG_SHAPES[case]
    folder = good_folder(tmp_path)
    planted = planted_file(folder, column, values)
    table = loader.load(folder)
    assert len(table) == GOOD_ROWS
    (why,) = [why for path, why in table.attrs["skipped_files"] if path == str(planted)]
    assert why.startswith("not a harness row:") and reason in why
    text = build_report(folder, out_dir=tmp_path / "out").markdown.read_text()
    assert "planted.parquet" in text and reason in text and NOT_DRAWN not in text


# Values of another width or unit than a row's, the same values all the same: read as rows
SAME_VALUES = {
    "batch as a narrower integer": ("batch", pa.array([4], pa.int32())),
    "batch as a whole float": ("batch", pa.array([4.0])),
    "a column null in every row": ("reason", pa.array([None], pa.null())),
    "strategy as large text": ("strategy", pa.array(["contiguous"], pa.large_string())),
    "timestamp in nanoseconds": ("timestamp", pa.array([0], pa.timestamp("ns"))),
}


@pytest.mark.parametrize("case", SAME_VALUES)
def test_a_file_whose_types_differ_only_in_width_is_read(tmp_path, case):
    folder = good_folder(tmp_path)
    planted_file(folder, *SAME_VALUES[case])
    table = loader.load(folder)
    assert len(table) == GOOD_ROWS + 1 and not table.attrs["skipped_files"]


def test_a_column_no_row_has_of_two_types_in_two_files_costs_only_that_column(tmp_path):
    folder = good_folder(tmp_path)
    planted_file(folder, "note", pa.array([1]), "one.parquet")
    planted_file(folder, "note", pa.array(["text"]), "two.parquet")
    table = loader.load(folder)
    assert len(table) == GOOD_ROWS + 2 and "note" not in table and not table.attrs["skipped_files"]


# One row whose point no run accepts, among good ones: (column, value, the words its line gives)
MUST_BE_AN_INTEGER = "must be an integer from 1"
ODD_ROWS = {
    "ctx 0": ("ctx", 0, f"ctx: {MUST_BE_AN_INTEGER}"), "a negative batch": ("batch", -1, f"batch: {MUST_BE_AN_INTEGER}"),
    "decode_tokens 0": ("decode_tokens", 0, f"decode_tokens: {MUST_BE_AN_INTEGER}"),
    "no layers": ("n_layers", 0, f"n_layers: {MUST_BE_AN_INTEGER}"), "head_dim 0": ("head_dim", 0, f"head_dim: {MUST_BE_AN_INTEGER}"),
    "no KV heads": ("n_kv_heads", 0, f"n_kv_heads: {MUST_BE_AN_INTEGER}"),
    "a negative vocabulary": ("vocab_size", -5, f"vocab_size: {MUST_BE_AN_INTEGER}"),
    "ctx missing": ("ctx", None, f"ctx: {MUST_BE_AN_INTEGER}"),
    "decode_tokens missing": ("decode_tokens", None, f"decode_tokens: {MUST_BE_AN_INTEGER}"),
    "no strategy": ("strategy", None, "strategy: names nothing"),
    "options that are not JSON": ("strategy_options", "{", "strategy_options: not a JSON object"),
    "an eviction score no model knows": ("cache_eviction_score", "zzz", "no prediction: "),
}


@pytest.mark.parametrize("case", ODD_ROWS)
def test_one_odd_row_costs_its_own_line(tmp_path, case):
    column, value, words = ODD_ROWS[case]
    folder = good_folder(tmp_path)
    here = build_report(folder, out_dir=tmp_path / "before").markdown.read_text()
    write_row(folder, {**row("contiguous", 4, 256), "roof_bandwidth_Bps": CPU_ROOF.bytes_per_s,
                       "roof_flops": CPU_ROOF.flops_per_s, column: value, "point_key": "odd"})
    text = build_report(folder, out_dir=tmp_path / "after").markdown.read_text()
    assert NOT_DRAWN not in text
    assert "1 row(s) could not be predicted" in text and words in text
    # the good rows' sections as they were: the plots and the summary of the cohort
    assert here.split("## Roofs")[0].split("Written")[1].split(".", 1)[1] == \
        text.split("## Roofs")[0].split("Written")[1].split(".", 1)[1]


# One row whose measurement no clock gives (a prefill timed at 0, below 0, forever): drawn and judged
# without it, no section lost
ODD_MEASURES = {"prefill timed at 0": ("prefill_s", 0.0), "prefill below 0": ("prefill_s", -1.0),
                "prefill forever": ("prefill_s", float("inf")), "bytes held infinite": ("kv_bytes_per_token_held", float("inf")),
                "bytes held below 0": ("kv_bytes_per_token_held", -1.0)}


@pytest.mark.parametrize("column", ["model", "strategy", "strategy_family", "dtype", "device_name", "point_key"])
def test_a_name_longer_than_a_file_name_costs_no_plot(tmp_path, column):
    folder = good_folder(tmp_path)
    planted_file(folder, column, pa.array(["x" * 5000]))
    text = build_report(folder, out_dir=tmp_path / "out").markdown.read_text()
    assert NOT_DRAWN not in text and "Traceback" not in text


@pytest.mark.parametrize("case", ODD_MEASURES)
def test_one_odd_measurement_costs_no_section(tmp_path, case):
    column, value = ODD_MEASURES[case]
    folder = good_folder(tmp_path)
    write_row(folder, {**row("contiguous", 4, 256), "roof_bandwidth_Bps": CPU_ROOF.bytes_per_s,
                       "roof_flops": CPU_ROOF.flops_per_s, column: value, "point_key": "odd"})
    assert NOT_DRAWN not in build_report(folder, out_dir=tmp_path / "out").markdown.read_text()


@pytest.mark.parametrize("column, value", [("batch", 2**62), ("ctx", 2**40), ("n_layers", 2**31 - 1)])
def test_a_row_of_a_huge_point_is_drawn_without_a_fault(tmp_path, column, value):
    folder = good_folder(tmp_path)
    write_row(folder, {**row("contiguous", 4, 256), "roof_bandwidth_Bps": CPU_ROOF.bytes_per_s,
                       "roof_flops": CPU_ROOF.flops_per_s, column: value, "point_key": "huge"})
    text = build_report(folder, out_dir=tmp_path / "out").markdown.read_text()
    assert NOT_DRAWN not in text and "could not be predicted" not in text


# Columns named as the loader names what it adds, or twice: (the planted file's columns, what is read)
def test_a_file_holding_the_loaders_own_column_is_read_as_its_rows(tmp_path):
    folder = good_folder(tmp_path)
    planted = planted_file(folder, "source_file", pa.array(["elsewhere.parquet"]))
    table = loader.load(folder)
    assert len(table) == GOOD_ROWS + 1 and set(table.loc[table["point_key"] == "planted.parquet", "source_file"]) == \
        {planted.name}


def test_a_file_with_a_column_twice_is_skipped_and_named(tmp_path):
    folder = good_folder(tmp_path)
    table = pq.read_table(next(folder.glob("contiguous*.parquet")))
    twice = pa.Table.from_arrays([*table.columns, table.column("batch")], names=[*table.column_names, "batch"])
    pq.write_table(twice, folder / "twice.parquet")
    loaded = loader.load(folder)
    (why,) = [why for path, why in loaded.attrs["skipped_files"] if path.endswith("twice.parquet")]
    assert len(loaded) == GOOD_ROWS and "batch" in why


def test_out_holding_the_users_files_keeps_them_and_a_second_report_removes_only_its_own(tmp_path):
    folder = good_folder(tmp_path)
    out = tmp_path / "mine"
    out.mkdir()
    (out / "holiday.png").write_bytes(b"the user's picture")
    (out / "notes.md").write_text("the user's notes")
    first = build_report(folder, out_dir=out)
    drawn = {path.name for path in first.figures}
    assert drawn and (out / "holiday.png").read_bytes() == b"the user's picture"
    assert set((out / MANIFEST).read_text().split()) == drawn | {"report.md", "rows.csv", "index.html"}
    for path in folder.glob("no_cache*.parquet"):  # the cohort's no-cache plot has no rows to draw now
        path.unlink()
    second = build_report(folder, out_dir=out)
    gone = drawn - {path.name for path in second.figures}
    assert gone and not any((out / name).exists() for name in gone)
    assert (out / "holiday.png").exists() and (out / "notes.md").exists()


def test_a_report_that_fails_while_writing_removes_nothing(tmp_path, monkeypatch):
    folder = good_folder(tmp_path)
    out = tmp_path / "out"
    first = build_report(folder, out_dir=out)
    for path in folder.glob("no_cache*.parquet"):
        path.unlink()

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(assemble, "to_html", full_disk)
    with pytest.raises(ReportError, match="No space left on device"):
        build_report(folder, out_dir=out)
    assert all(path.exists() for path in first.figures)  # the previous report.md's images are all there


def test_a_manifest_naming_other_files_removes_none_of_them(tmp_path):
    folder = good_folder(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    outside = tmp_path / "outside.txt"
    outside.write_text("not the report's")
    (out / ".hidden").write_text("not the report's")
    (out / MANIFEST).write_text(f"../outside.txt\n{outside}\n.hidden\n")
    build_report(folder, out_dir=out)
    assert outside.exists() and (out / ".hidden").exists()


def test_a_killed_reports_temporaries_are_removed_by_the_next(tmp_path):
    folder = good_folder(tmp_path)
    out = tmp_path / "out"
    build_report(folder, out_dir=out)
    dead = 2**22 + 17  # above the kernel's default pid_max: no process has it
    (out / f".report.md.tmp-{dead}").write_text("half")
    build_report(folder, out_dir=out)
    assert not (out / f".report.md.tmp-{dead}").exists()


def out_cases(tmp_path) -> dict:
    folder = good_folder(tmp_path)
    rows_elsewhere = write_results(tmp_path / "other", awkward=False, batches=(1,), contexts=(64,))
    return {  # out= -> what the refusal says
        "the results folder": (folder, "is the results folder"),
        "a folder in it the readers read": (folder / "summary", "lies in the results folder"),
        "a folder of rows": (rows_elsewhere, "holds row files"),
        "the baseline folder": (tmp_path / "base", "is the results folder"),
    }


@pytest.mark.parametrize("case", ["the results folder", "a folder in it the readers read", "a folder of rows",
                                  "the baseline folder"])
def test_an_out_among_rows_is_refused_in_one_line_before_anything_is_written(tmp_path, case):
    out, words = out_cases(tmp_path)[case]
    folder = tmp_path / "results"
    baseline = write_results(tmp_path / "base", awkward=False, batches=(1,), contexts=(64,))
    before = {path: path.stat().st_mtime_ns for path in tmp_path.rglob("*")}
    answer = cli(f"results_dir={folder}", f"out={out}", f"baseline={baseline}", module="harness.report")
    assert answer.returncode == 2 and only_line(answer.stderr).startswith("out: ") and words in answer.stderr
    assert {path: path.stat().st_mtime_ns for path in tmp_path.rglob("*")} == before


def test_an_out_in_the_results_folder_under_an_underscore_is_the_reports(tmp_path):
    folder = good_folder(tmp_path)
    files = build_report(folder, out_dir=folder / "_summary")
    assert files.markdown.exists() and len(loader.load(folder)) == GOOD_ROWS and not loader.load(folder).attrs["skipped_files"]


def test_an_unknown_datasheet_is_refused_before_any_file_is_read(tmp_path, monkeypatch):
    folder = good_folder(tmp_path)
    monkeypatch.setattr(loader, "read_files", lambda *a, **k: pytest.fail("read before the refusal"))
    with pytest.raises(ReportError, match="^hardware: unknown datasheet 'h900', allowed: "):
        build_report(folder, "h900", out_dir=tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_the_report_folder_is_not_a_row_of_pandas_read_parquet(tmp_path):
    pd = pytest.importorskip("pandas")
    folder = good_folder(tmp_path)
    build_report(folder)
    assert len(pd.read_parquet(folder)) == GOOD_ROWS and os.path.isdir(folder / "_report")

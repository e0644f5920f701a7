"""A folder of thousands of row files: every row read, the odd file named, each file read once and only
for the columns the report reads, the read split among processes giving the table and the skipped files
an in-process read gives, and the loader's cost set against Arrow's own read of the same files in the
same run (slow tier: a ratio, skipped with the measured reason when other processes took the CPUs).
"""
from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.dataset as ds
import pytest

from harness.analysis import results, row_files
from harness.report import assemble
from harness.measure.contention import CONTENTION_LIMIT, CpuTimes, others_fraction
from harness.report.assemble import build_report
from harness.report.unread import UNREAD_COLUMNS
from harness.store.columns import COLUMN_NAMES
from tests.conftest import REPO_ROOT
from tests.report_fixtures import write_variant_results

_spec = importlib.util.spec_from_file_location("many_rows", REPO_ROOT / "scripts" / "many_rows.py")
many_rows = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(many_rows)


def children_cpu_s() -> float:
    """CPU seconds of this process's children that it has waited for (the loader's reader processes)."""
    times = os.times()
    return times.children_user + times.children_system


def many(tmp_path, count: int):
    source = write_variant_results(tmp_path / "source", contexts=(256,))
    return many_rows.write_many(source, tmp_path / "many", count) and tmp_path / "many"


def test_a_folder_of_row_files_is_read_whole_and_a_foreign_file_among_them_named(tmp_path):
    import pandas as pd

    folder = many(tmp_path, 240)
    pd.DataFrame({"x": [1, 2]}).to_parquet(folder / "foreign.parquet", index=False)
    table = results.load(folder)
    assert len(table) == 240 and table["source_file"].nunique() == 240 and "x" not in table
    assert any(path.endswith("foreign.parquet") and "missing columns" in why for path, why in table.attrs["skipped_files"])


def test_a_damaged_file_among_them_is_named_and_the_others_read(tmp_path):
    folder = many(tmp_path, 60)
    (folder / "damaged.parquet").write_bytes(b"PAR1 not a parquet file")
    table = results.load(folder)
    assert len(table) == 60
    assert [why.split(":")[0] for path, why in table.attrs["skipped_files"] if path.endswith("damaged.parquet")] == \
        ["corrupt Parquet"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the read is split among forked processes on Linux only")
def test_the_read_split_among_processes_gives_the_table_and_the_skipped_files_of_the_read_in_one(tmp_path, monkeypatch):
    """Odd entries spread over the slices (a foreign Parquet file, a damaged one, a folder, a text file): the
    slices read in forked processes and joined give the same table, column for column, and the same skipped
    entries with the same reasons in the same order as the whole folder read in this process."""
    import pandas as pd

    folder = many(tmp_path, 120)
    pd.DataFrame({"x": [1, 2]}).to_parquet(folder / "a_foreign.parquet", index=False)  # first slice: this process
    (folder / "m_damaged.parquet").write_bytes(b"PAR1 not a parquet file")
    (folder / "n_folder").mkdir()
    (folder / "z_notes.txt").write_text("not a row")
    (folder / "zz_damaged.parquet").write_bytes(b"")  # last slice: a forked reader
    left_out = UNREAD_COLUMNS[:5]
    alone, alone_skipped = row_files.read_files(folder, left_out)
    split, read_in_processes = [], row_files._read_in_processes
    monkeypatch.setattr(row_files, "_processes", lambda files: 3)
    monkeypatch.setattr(row_files, "_read_in_processes", lambda slices, *args: (
        split.append([len(s) for s in slices]), read_in_processes(slices, *args))[1])
    together, together_skipped = row_files.read_files(folder, left_out)
    assert split == [[41, 41, 41]]  # the 123 .parquet files in three slices: two read by forked processes
    assert together.equals(alone) and together.schema == alone.schema and together.num_rows == 120
    assert together["source_file"].to_pylist() == alone["source_file"].to_pylist()
    assert together_skipped == alone_skipped
    assert [(Path(path).name, why.split(":")[0]) for path, why in together_skipped] == [
        ("n_folder", "a folder"), ("z_notes.txt", "not a .parquet file (pandas.read_parquet on the results folder "
                                                  "will fail on it)"),
        ("a_foreign.parquet", "not a harness row"), ("m_damaged.parquet", "corrupt Parquet"),
        ("zz_damaged.parquet", "corrupt Parquet")]


def test_a_folder_of_few_files_is_read_in_this_process_and_never_by_more_processes_than_cpus(monkeypatch):
    """Forking a reader pays only for a share of many files; and a reader per usable CPU at most."""
    if not sys.platform.startswith("linux"):
        assert row_files._processes(100 * row_files.FILES_PER_PROCESS) == 1
        return
    monkeypatch.setattr(row_files.os, "sched_getaffinity", lambda pid: {0, 1, 2})
    assert row_files._processes(2 * row_files.FILES_PER_PROCESS - 1) == 1
    assert row_files._processes(2 * row_files.FILES_PER_PROCESS) == 2
    assert row_files._processes(100 * row_files.FILES_PER_PROCESS) == 3


def test_the_report_reads_each_file_once_and_leaves_the_columns_it_never_reads_in_the_files(tmp_path, monkeypatch):
    """Each row file is read once, for every column but the report's unread ones (in a one-row file each
    column costs a decode); the report is the same, timestamp aside, as one built from every column."""
    folder = many(tmp_path, 90)
    asked = []
    read = row_files.pq.ParquetFile.read
    monkeypatch.setattr(row_files.pq.ParquetFile, "read", lambda self, columns=None, **kw: (
        asked.append(columns), read(self, columns=columns, **kw))[1])
    lean = build_report(folder, out_dir=tmp_path / "lean").markdown.read_text()
    assert len(asked) == 90 and all(columns and not set(columns) & set(UNREAD_COLUMNS) for columns in asked)
    monkeypatch.setattr(assemble, "UNREAD_COLUMNS", ())
    whole = build_report(folder, out_dir=tmp_path / "whole").markdown.read_text()
    written = re.compile(r"Written [^.]*UTC")
    assert written.sub("", lean) == written.sub("", whole)


def test_no_module_the_report_runs_names_a_column_it_leaves_unread():
    """A column left unread loads as null: a section that started reading one would see nothing. So no
    module the report imports that handles rows (its own, the loader's and analysis', the upgrade's) names
    one, quoted or as an attribute."""
    assert set(UNREAD_COLUMNS) <= set(COLUMN_NAMES)
    imported = subprocess.run(  # a fresh process: this one holds what other tests imported
        [sys.executable, "-c", "import sys, harness.report.__main__; print('\\n'.join(m.__file__ for n, m in "
         "sys.modules.items() if n.startswith('harness.') and getattr(m, '__file__', None)))"],
        cwd=REPO_ROOT, capture_output=True, text=True, check=True).stdout.split()
    touching_rows = ("harness/report/", "harness/analysis/", "harness/store/upgrade.py")  # config and calibration: no rows
    sources = {path: open(path).read() for path in imported
               if any(part in path for part in touching_rows) and not path.endswith("unread.py")}
    assert any(path.endswith("assemble.py") for path in sources) and any(path.endswith("upgrade.py") for path in sources)
    named = {(column, Path(path).name) for column in UNREAD_COLUMNS for path, text in sources.items()
             if re.search(rf"""['"]{column}['"]|\.{column}\b""", text)}
    assert not named, f"read by the report but left unread (harness/report/unread.py): {sorted(named)}"


FILES = 1000  # row files the loader and Arrow read


@pytest.mark.slow
@pytest.mark.serial  # two reads timed against each other: another process on the CPUs makes it skip
def test_loading_a_thousand_row_files_costs_little_beyond_arrows_own_read_of_them(tmp_path):
    """The loader over 1,000 files (read, upgraded, deduplicated, predicted) against one pyarrow dataset
    read of the same files, timed in the same run; the report over them then builds (its plotting
    sections in a forked process: harness.report.apart). A thousand, not more, for CI's time: the costs
    compared are per file."""
    folder = many(tmp_path, FILES)
    paths = sorted(str(p) for p in folder.glob("*.parquet"))
    start, forked = CpuTimes.now(), children_cpu_s()
    began = time.perf_counter()
    ds.dataset(paths, format="parquet").to_table()
    arrow_s = time.perf_counter() - began
    began = time.perf_counter()
    table = results.load(folder)
    load_s = time.perf_counter() - began
    end = CpuTimes.now()  # the loader's reader processes, waited for by now, are this test's own work
    busy = others_fraction(start, dataclasses.replace(end, mine=end.mine + children_cpu_s() - forked))
    if busy > CONTENTION_LIMIT:
        pytest.skip(f"other processes took {busy:.0%} of the CPUs while the two reads were timed "
                    f"(loader {load_s:.1f} s, Arrow {arrow_s:.1f} s)")
    assert len(table) == FILES
    # The loader reads every file on its own, as Arrow's dataset does, but not the columns the report never
    # reads, with the CPUs shared as Arrow shares them, and adds only vectorised steps and one prediction
    # per distinct point: it stays well within twice Arrow's read.
    assert load_s < 2 * arrow_s + 1.0, f"loader {load_s:.2f} s against Arrow's read {arrow_s:.2f} s"
    files = build_report(folder, out_dir=tmp_path / "report")
    assert "## This machine, point by point" in files.markdown.read_text()

"""A folder of thousands of row files: every row read, the odd file named, each file read once and only
for the columns the report reads, and the loader's cost set against Arrow's own read of the same files
in the same run (slow tier: a ratio, skipped with the measured reason when other processes took the CPUs).
"""
from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.dataset as ds
import pytest

from harness.analysis import results
from harness.report import assemble
from harness.measure.contention import CONTENTION_LIMIT, CpuTimes, others_fraction_since
from harness.report.assemble import build_report
from harness.report.unread import UNREAD_COLUMNS
from harness.store.columns import COLUMN_NAMES
from tests.conftest import REPO_ROOT
from tests.report_fixtures import write_variant_results

_spec = importlib.util.spec_from_file_location("many_rows", REPO_ROOT / "scripts" / "many_rows.py")
many_rows = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(many_rows)


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


def test_the_report_reads_each_file_once_and_leaves_the_columns_it_never_reads_in_the_files(tmp_path, monkeypatch):
    """Each row file is read once, for every column but the report's unread ones (in a one-row file each
    column costs a decode); the report is the same, timestamp aside, as one built from every column."""
    folder = many(tmp_path, 90)
    asked = []
    read = results.pq.ParquetFile.read
    monkeypatch.setattr(results.pq.ParquetFile, "read", lambda self, columns=None, **kw: (
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


@pytest.mark.slow
def test_loading_thousands_of_row_files_costs_little_beyond_arrows_own_read_of_them(tmp_path):
    """The loader over 3,000 files (read, upgraded, deduplicated, predicted) against one pyarrow dataset
    read of the same files, timed in the same run; the report over them then builds."""
    folder = many(tmp_path, 3000)
    paths = sorted(str(p) for p in folder.glob("*.parquet"))
    start = CpuTimes.now()
    began = time.perf_counter()
    ds.dataset(paths, format="parquet").to_table()
    arrow_s = time.perf_counter() - began
    began = time.perf_counter()
    table = results.load(folder)
    load_s = time.perf_counter() - began
    busy = others_fraction_since(start)
    if busy > CONTENTION_LIMIT:
        pytest.skip(f"other processes took {busy:.0%} of the CPUs while the two reads were timed "
                    f"(loader {load_s:.1f} s, Arrow {arrow_s:.1f} s)")
    assert len(table) == 3000
    # The loader adds to the read only vectorised steps and one prediction per distinct point.
    assert load_s < 4 * arrow_s + 1.0, f"loader {load_s:.2f} s against Arrow's read {arrow_s:.2f} s"
    files = build_report(folder, out_dir=tmp_path / "report")
    assert "## This machine, point by point" in files.markdown.read_text()

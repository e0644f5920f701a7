"""Rows on disk: one Parquet file per point, written whole or not at all.

A row is written by harness.files.write_whole: a hidden temporary file in the results folder, flushed
to disk, then renamed over its final name. Rename within one filesystem is atomic, so a reader (or a
sweep killed with SIGKILL) only ever sees whole files; the temporary name starts with '.', which
pyarrow's dataset discovery and our own glob both skip. A file's name ends in the point's key, so finding finished points is a
directory listing plus a read of each candidate's footer: a file counts as finished only if it reads as
Parquet and holds one row (a truncated file left by a full disk or a foreign writer is measured again).
`finished_row(results_dir, key)` is that one definition, with the row's status and git_commit, which
the runner needs to re-run failed rows and to report rows that other code made.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from harness.files import write_whole
from harness.store.columns import ITERATION_SCHEMA, REQUEST_SCHEMA, SCHEMA

KEY_PATTERN = re.compile(r"[0-9a-f]{16}")  # harness.config.point.Point.key
KEY_IN_NAME = re.compile(r"__([0-9a-f]{16})\.parquet$")
TEMP_NAME = re.compile(r"^\.(.+\.parquet)\.tmp-(\d+)$")


REQUESTS_DIR = "_requests"  # a serving run's per-request files, under results_dir ('_': pyarrow skips it)
ITERATIONS_DIR = "_iterations"  # a measured serving run's iteration logs, likewise


# Bytes of a row file's name before its key: with the key and the suffix (the key's 16 hex digits and
# ".parquet", and a temporary's suffix while it is written) well within a file name's 255 bytes.
DESCRIBED_MAX = 180


def row_filename(row: dict) -> str:
    """Named by the strategy's class (`strategy_family`), not its variant name: one point has one file
    whichever variant name measured it (a variant and the same options set by hand share the key). A
    serving run's is named by its workload instead of its batch and context."""
    shape = f"serve-{row['workload']}" if row.get("workload") is not None else f"b{row['batch']}__ctx{row['ctx']}"
    described = f"{row['strategy_family']}__{row['model']}__{shape}".encode()
    if len(described) > DESCRIBED_MAX:  # a long checkpoint name: the key alone finds the file (finished_row)
        described = described[:DESCRIBED_MAX].decode(errors="ignore").encode()  # whole UTF-8 characters
    return f"{described.decode()}__{row['point_key']}.parquet"


@dataclass(frozen=True)
class FinishedRow:
    """A row file that reads and holds one row: what a re-run needs to know of it."""

    path: Path
    status: Optional[str]  # ok | skipped | failed
    git_commit: Optional[str]  # the code state that wrote it (harness.run.metadata.git_commit)
    noise_reason: Optional[str] = None  # why its timing is suspect (a slow window pending its second measurement)


def read_finished(path: Path) -> FinishedRow | None:
    """The row of a finished file, or None when the file does not read as Parquet or does not hold
    exactly one row (truncated, empty, another writer's)."""
    try:
        parquet = pq.ParquetFile(path)
        if parquet.metadata.num_rows != 1:
            return None
        names = set(parquet.schema_arrow.names)
        columns = [c for c in ("status", "git_commit", "noise_reason") if c in names]
        values = parquet.read(columns=columns).to_pylist()[0] if columns else {}
    except Exception:  # pyarrow raises several types for a damaged file
        return None
    return FinishedRow(path=path, status=values.get("status"), git_commit=values.get("git_commit"),
                       noise_reason=values.get("noise_reason"))


def finished_row(results_dir: str | Path, key: str) -> FinishedRow | None:
    """The finished row of the point with this key, or None: the one definition of a finished point
    (a file whose name carries the key, that reads, and that holds one row)."""
    folder = Path(results_dir)
    if not KEY_PATTERN.fullmatch(key) or not folder.is_dir():
        return None
    for path in sorted(folder.glob(f"*__{key}.parquet")):
        row = read_finished(path)
        if row is not None:
            return row
    return None


def finished_rows(results_dir: str | Path) -> dict[str, FinishedRow]:
    """Key -> finished row, for every finished row file of the folder."""
    folder = Path(results_dir)
    rows = {}
    for path in sorted(folder.glob("*.parquet")) if folder.is_dir() else ():
        match = KEY_IN_NAME.search(path.name)
        if match and match.group(1) not in rows and (row := read_finished(path)) is not None:
            rows[match.group(1)] = row
    return rows


def row_table(row: dict) -> pa.Table:
    """One row as an Arrow table of the schema, with pandas metadata that makes pandas.read_parquet give
    nullable Int64 and boolean columns (not float64 and object where a value is null)."""
    frame = pd.DataFrame([row])
    for field in SCHEMA:
        if pa.types.is_integer(field.type):
            frame[field.name] = frame[field.name].astype("Int64")
        elif pa.types.is_boolean(field.type):
            frame[field.name] = frame[field.name].astype("boolean")
        elif pa.types.is_floating(field.type):
            frame[field.name] = frame[field.name].astype("float64")
        elif pa.types.is_string(field.type):
            frame[field.name] = frame[field.name].astype("object")
    return pa.Table.from_pandas(frame, schema=SCHEMA, preserve_index=False)


def write_row(results_dir: str | Path, row: dict) -> Path:
    """Write one row atomically (harness.files.write_whole); replaces an older row of the same point."""
    folder = Path(results_dir)
    folder.mkdir(parents=True, exist_ok=True)
    table = row_table(row)
    return write_whole(folder / row_filename(row), lambda handle: pq.write_table(table, handle))


def write_requests(results_dir: str | Path, row: dict, requests: list[dict]) -> Path:
    """A serving run's per-request records (harness.store.columns.REQUEST_COLUMNS), one Parquet row each,
    written atomically to <results_dir>/_requests/ under its row's file name."""
    folder = Path(results_dir) / REQUESTS_DIR
    folder.mkdir(parents=True, exist_ok=True)
    frame = pd.DataFrame(requests, columns=[field.name for field in REQUEST_SCHEMA])
    for field in REQUEST_SCHEMA:
        if pa.types.is_integer(field.type):
            frame[field.name] = frame[field.name].astype("Int64")
        elif pa.types.is_floating(field.type):
            frame[field.name] = frame[field.name].astype("float64")
    table = pa.Table.from_pandas(frame, schema=REQUEST_SCHEMA, preserve_index=False)
    return write_whole(folder / row_filename(row), lambda handle: pq.write_table(table, handle))


def write_iterations(results_dir: str | Path, row: dict, log: dict[str, list]) -> Path:
    """A measured serving run's iteration log (harness.store.columns.ITERATION_COLUMNS, as columns),
    written atomically to <results_dir>/_iterations/ under its row's file name."""
    table = pa.Table.from_pydict({field.name: log[field.name] for field in ITERATION_SCHEMA}, schema=ITERATION_SCHEMA)
    folder = Path(results_dir) / ITERATIONS_DIR
    folder.mkdir(parents=True, exist_ok=True)
    return write_whole(folder / row_filename(row), lambda handle: pq.write_table(table, handle))


def read_iterations(results_dir: str | Path, row_file: str) -> dict[str, list] | None:
    """The iteration log beside the row file named `row_file`, as columns; None where it has none."""
    path = Path(results_dir) / ITERATIONS_DIR / row_file
    return pq.read_table(path).to_pydict() if path.is_file() else None


def remove_stale_temporaries(results_dir: str | Path) -> list[Path]:
    """Delete temporary files left by writers that were killed (their process no longer exists)."""
    folder = Path(results_dir)
    removed = []
    temporaries = [path for sub in (folder, folder / REQUESTS_DIR, folder / ITERATIONS_DIR)
                   for path in sub.glob(".*.parquet.tmp-*")] if folder.is_dir() else []
    for path in temporaries:
        match = TEMP_NAME.match(path.name)
        if match and not _process_alive(int(match.group(2))):
            path.unlink(missing_ok=True)
            removed.append(path)
    return removed


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True

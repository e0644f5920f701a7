"""Read a results folder's row files into one Arrow table, each file checked on its own.

    table, skipped = read_files(folder)  # skipped: [(path, why it is not read as rows)], in path order

Every `*.parquet` file at the top level of the folder is read and checked alone, so one corrupt or foreign
file is named and skipped instead of failing the whole read; names starting with '_' or '.' (the report,
Hydra's logs, the calibration) are never rows. A one-row file costs its reader little beside opening it and
parsing a footer that describes each of its ~190 columns, work that holds the GIL for much of its time:
threads hide the disk but not that. So a folder of many files is split into contiguous slices read at once, the first in this
process and each other one in a forked process that sends back its slice as one Arrow table (IPC bytes)
and its skipped files; joined in slice order, they make the table and the list an in-process read makes.
"""
from __future__ import annotations

import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from harness.config.validate import first_line
from harness.files.workers import Forked, WorkerLost, patience
from harness.store.columns import SCHEMA

# Columns a file must have to be read as a harness row (the rest may be missing in older rows).
REQUIRED_COLUMNS = (
    "strategy", "model", "vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim",
    "ffn_dim", "dtype", "device", "batch", "ctx", "decode_tokens", "status",
)
# Files read at once by a process that reads alone: pyarrow decodes without the GIL, so a second thread
# decodes one file while the first parses the next; more threads only pass the GIL back and forth (four
# read slower than two on two CPUs). A process among several reads in one thread: the others keep the
# CPUs busy, and a thread would add only those handoffs.
READ_THREADS = 2
# Files per process: a folder of fewer than twice this many is read in this process alone, where forking
# a reader and sending its table back costs about what the reader's share of the read saves; a folder of
# more gets one process per this many files, up to the CPUs this process may run on.
FILES_PER_PROCESS = 250

Skipped = list[tuple[str, str]]  # (path, why it is not read as rows), in the folder's order
SOURCE_FILE = "source_file"  # the column naming each row's file, added by read_slice


def row_paths(folder: Path) -> tuple[list[Path], Skipped]:
    """The folder's candidate row files in name order, and the entries that cannot be rows (folders,
    other suffixes), each with why."""
    paths, skipped = [], []
    for path in sorted(folder.iterdir()) if folder.is_dir() else []:
        if path.name.startswith(("_", ".")):
            continue
        if path.is_dir():
            skipped.append((str(path), "a folder: not read (pandas.read_parquet on the results folder would read it as a partition)"))
        elif path.suffix != ".parquet":
            skipped.append((str(path), "not a .parquet file (pandas.read_parquet on the results folder will fail on it)"))
        else:
            paths.append(path)
    return paths, skipped


def read_files(folder, left_out: tuple[str, ...] = ()) -> tuple[pa.Table | None, Skipped]:
    """Every row of the folder's row files as one table, each row's file name in `source_file` (None: no
    file held a row), and the entries not read, with why. `left_out`: columns not read (the loader adds
    them back null)."""
    paths, skipped = row_paths(Path(folder))
    slices = _slices(paths, _processes(len(paths)))
    parts = _read_in_processes(slices, tuple(left_out)) if len(slices) > 1 else [read_slice(paths, tuple(left_out))]
    tables = [table for table, _ in parts if table is not None]
    skipped += [entry for _, not_rows in parts for entry in not_rows]
    return (_compact(tables) if tables else None), skipped


def _processes(files: int) -> int:
    """How many processes read `files` files: one per FILES_PER_PROCESS, at most one per usable CPU, and
    one where the platform cannot fork (Windows; macOS, whose system libraries are not safe to use in a
    forked child): forking is what makes a reader cheap to start, with pyarrow already imported."""
    if not sys.platform.startswith("linux"):
        return 1
    cpus = len(os.sched_getaffinity(0))  # the CPUs this process may run on, not the machine's count
    return max(1, min(cpus, files // FILES_PER_PROCESS))


def _slices(paths: list[Path], count: int) -> list[list[Path]]:
    """`paths` cut into `count` contiguous slices of nearly equal length, in order."""
    size, extra = divmod(len(paths), count)
    bounds = [i * size + min(i, extra) for i in range(count + 1)]
    return [paths[start:end] for start, end in zip(bounds, bounds[1:])]


def _read_in_processes(slices: list[list[Path]], left_out: tuple[str, ...]) -> list[tuple[pa.Table | None, Skipped]]:
    """Each slice's (table, skipped): the first read here while forked workers read the others
    (harness.files.workers: they end with this process, and a wait on one is bounded). A worker that sends
    nothing back (killed: out of memory; stuck) has its slice read here after all."""
    with ExitStack() as workers:
        # Forked before this process starts its own read: the fork then copies no reader thread mid-call.
        forked = [workers.enter_context(Forked(_read_slice_ipc, paths, left_out)) for paths in slices[1:]]
        started = time.monotonic()
        parts = [read_slice(slices[0], left_out, threads=1)]
        deadline = started + patience(time.monotonic() - started)
        for worker, paths in zip(forked, slices[1:]):
            try:
                body, skipped = worker.result(max(0.0, deadline - time.monotonic()))
            except WorkerLost:
                parts.append(read_slice(paths, left_out))
                continue
            parts.append((pa.ipc.open_stream(body).read_all() if body is not None else None, skipped))
    return parts


def _read_slice_ipc(paths: list[Path], left_out: tuple[str, ...]) -> tuple[bytes | None, Skipped]:
    """read_slice in a reader process: its table as Arrow IPC stream bytes, the one form sent back whole."""
    table, skipped = read_slice(paths, left_out, threads=1)
    if table is None:
        return None, skipped
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes(), skipped


def read_slice(paths: list[Path], left_out: tuple[str, ...] = (),
               threads: int = READ_THREADS) -> tuple[pa.Table | None, Skipped]:
    """The rows of `paths` as one compact table (None: none held a row), and the files not read, with why;
    read in `threads` threads."""
    runs: list[_Run] = []  # consecutive files of one schema each
    names, skipped = [], []
    unread = frozenset(left_out)
    with ThreadPoolExecutor(max_workers=threads) as pool:
        mapped = pool.map if threads > 1 else map  # one thread: no handoff to a pool's thread and back
        for path, (table, why) in zip(paths, mapped(lambda path: read_one(path, unread), paths)):
            if table is not None and (not runs or table.schema != runs[-1].schema):  # a file of another schema
                table, why = conformed(table)
            if table is None:
                skipped.append((str(path), why))
                continue
            if not runs or table.schema != runs[-1].schema:
                runs.append(_Run(table.schema))
            runs[-1].add(table)
            names += [path.name] * table.num_rows
    if not runs:
        return None, skipped
    # The file names added once: a column appended to each file's table costs a fifth of its read.
    return _compact([run.table() for run in runs]).append_column(SOURCE_FILE, pa.array(names, pa.string())), skipped


class _Run:
    """Consecutive files of one schema, each file's table written to an Arrow IPC stream as soon as it is read.
    Held as tables until joined, thousands of one-row tables cost far more memory than their rows (Arrow's
    objects for each column), and the files read meanwhile a third more time each."""

    def __init__(self, schema: pa.Schema):
        self.schema = schema  # every table added has it
        self._sink = pa.BufferOutputStream()  # the stream's bytes: each row's values and little else
        self._writer = pa.ipc.new_stream(self._sink, schema)

    def add(self, table: pa.Table) -> None:
        self._writer.write_table(table)

    def table(self) -> pa.Table:
        """The run's rows as one table, each column one chunk; the run takes no more rows."""
        self._writer.close()
        return pa.ipc.open_stream(self._sink.getvalue()).read_all().combine_chunks()


def _compact(tables: list[pa.Table]) -> pa.Table:
    """The tables as one, each column one chunk. One chunk, not one per file: pandas keeps a string column as
    the Arrow chunks it was given, and every later row selection (a cohort, a point) would then take from
    thousands of one-row chunks."""
    schema = tables[0].schema
    # Tables of one schema are joined as they are. Older files lack newer columns, and a column null in every
    # row of a file is typed null there: tables of several schemas are unified first (several times the cost).
    same = all(table.schema == schema for table in tables)
    try:
        return pa.concat_tables(tables, promote_options="none" if same else "permissive").combine_chunks()
    except (pa.ArrowInvalid, pa.ArrowTypeError):  # a column no row of today has, of two types in two files
        foreign = {field.name for table in tables for field in table.schema if field.name not in ROW_TYPES}
        tables = [table.drop_columns([c for c in table.column_names if c in foreign]) for table in tables]
        return pa.concat_tables(tables, promote_options="permissive").combine_chunks()


def conformed(table: pa.Table) -> tuple[pa.Table | None, str]:
    """(the table, its columns of today's schema at their row types, "") or (None, why it is not read as
    rows). A column's type may differ from its row type only where its values are the row's all the same: a
    column null in every row (typed null), another integer width, a float column of whole numbers, strings
    or lists of another offset width, a timestamp of another unit. Any other type (a batch held as text, a
    status as a number, a reason as a struct) is another program's column of that name: the file is not
    read, and one file of the wrong shape costs only itself (joined with the others, its column would
    fail the whole read). Columns today's schema lacks (a newer harness's) are kept as they are."""
    names = table.column_names
    if len(set(names)) < len(names):
        twice = sorted({name for name in names if names.count(name) > 1})
        return None, f"not a harness row: column {', '.join(twice)} appears twice"
    if SOURCE_FILE in names:  # the loader's own column (each row's file): a file cannot say where it is
        table = table.drop_columns([SOURCE_FILE])
    casts = {}
    for field in table.schema:
        want = ROW_TYPES.get(field.name)
        if want is None or field.type == want or pa.types.is_null(field.type):
            continue
        if _kind(field.type) != _kind(want):
            return None, f"not a harness row: column {field.name} is {field.type}, a row's is {want}"
        casts[field.name] = want
    for name, want in casts.items():
        index = table.schema.get_field_index(name)
        try:
            table = table.set_column(index, name, table.column(index).cast(want, safe=True))
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as error:
            return None, f"not a harness row: column {name} does not read as {want} ({first_line(error, typed=False)})"
    return table, ""


ROW_TYPES = {field.name: field.type for field in SCHEMA}  # each column's type in a row of today's schema


def _kind(arrow_type: pa.DataType) -> str:
    """What a type's values are, whatever their width or unit: the types conformed() casts between."""
    if pa.types.is_integer(arrow_type) or pa.types.is_floating(arrow_type):
        return "number"
    if pa.types.is_string(arrow_type) or pa.types.is_large_string(arrow_type):
        return "string"
    if pa.types.is_timestamp(arrow_type):
        return "timestamp"
    if pa.types.is_list(arrow_type) or pa.types.is_large_list(arrow_type):
        return f"list of {_kind(arrow_type.value_type)}"
    return str(arrow_type)


def read_one(path: Path, left_out: frozenset = frozenset()) -> tuple[pa.Table | None, str]:
    """(the file's rows, "") or (None, why it is not read as rows)."""
    try:
        # Not read_table (its dataset machinery costs twice the read of a one-row file), and without Arrow's
        # thread pool and read-ahead: for one row, handing each column to a thread costs more than decoding it.
        file = pq.ParquetFile(path, pre_buffer=False)
        names = file.schema_arrow.names
        missing = [c for c in REQUIRED_COLUMNS if c not in names]
        if missing:
            return None, f"not a harness row: missing columns {', '.join(missing)}"
        table = file.read(columns=[c for c in names if c not in left_out], use_threads=False)
    except Exception as error:  # pyarrow raises several types for a damaged file
        return None, f"corrupt Parquet: {first_line(error, typed=False)}"
    return table.replace_schema_metadata(None), ""  # pandas metadata of one file would rename another's index

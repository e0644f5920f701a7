"""The report's tables: every row beside its prediction, the roofs used, rows and files not measured."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pandas as pd

from harness.report import units as fmt
from harness.report.document import Table
from harness.report.cohorts import cached_rows, newest_per_point, plain_cache_strategy, SERIES

ROW_ORDER = ["model", "device", "dtype", SERIES, "batch", "ctx"]


def _get(row, key):
    return row[key] if key in row.index else None


def without_empty_columns(block: Table) -> Table:
    """The table without the columns that are empty ("–") in every row (e.g. counters a CPU lacks)."""
    keep = [i for i in range(len(block.header)) if any(row[i] not in ("–", "", "None") for row in block.rows)]
    right = block.align_right or [False] * len(block.header)
    return Table([block.header[i] for i in keep], [[row[i] for i in keep] for row in block.rows], [right[i] for i in keep])


@dataclass(frozen=True)
class Column:
    """One column of the rows table: its heading, the row columns it shows (rows.csv carries them under
    these names, as numbers), and how its cell is written for a reader."""

    header: str  # distinct from every other column's, saying what it holds
    sources: tuple[str, ...]  # the row's columns it is made of (docs/columns.md)
    cell: Callable[[pd.Series], str]
    right: bool = True  # a number: aligned right


def _as(how: Callable, column: str) -> Callable:
    """A cell that writes the row's `column` with `how` (a units function; str for text)."""
    return lambda row: how(_get(row, column))


def _bytes_and_source(row) -> str:
    measured = _get(row, "bytes_per_step_measured")
    if fmt.missing(measured):
        return f"{fmt.nbytes(_get(row, 'bytes_per_step_model'))} (model)"
    return f"{fmt.nbytes(measured)} ({_get(row, 'traffic_source') or 'measured'})"


# The one model of the rows table: report.md and index.html render its cells, rows.csv its sources.
ROW_COLUMNS = [
    Column("strategy", (SERIES, "strategy"), _as(str, SERIES), False),
    Column("model", ("model",), _as(str, "model"), False),
    Column("dtype", ("dtype",), _as(str, "dtype"), False),
    Column("device", ("device",), _as(str, "device"), False),
    Column("batch", ("batch",), lambda row: fmt.count(row["batch"])),
    Column("ctx", ("ctx",), lambda row: fmt.count(row["ctx"])),
    Column("status", ("status",), _as(str, "status"), False),
    Column("step measured", ("decode_step_s",), _as(fmt.seconds, "decode_step_s")),
    Column("step roofline", ("predicted_step_s",), _as(fmt.seconds, "predicted_step_s")),
    Column("step ÷ roofline", ("ratio_decode_step_s",), _as(fmt.ratio, "ratio_decode_step_s")),
    Column("prefill measured", ("prefill_s",), _as(fmt.seconds, "prefill_s")),
    Column("prefill roofline", ("predicted_prefill_s",), _as(fmt.seconds, "predicted_prefill_s")),
    Column("prefill ÷ roofline", ("ratio_prefill_s",), _as(fmt.ratio, "ratio_prefill_s")),
    Column("bytes/step (source)", ("bytes_per_step_measured", "traffic_source"), _bytes_and_source),
    Column("bytes/step analytic", ("bytes_per_step_model",), _as(fmt.nbytes, "bytes_per_step_model")),
    Column("bytes ÷ analytic", ("ratio_bytes_per_step_measured",), _as(fmt.ratio, "ratio_bytes_per_step_measured")),
    Column("cache allocated", ("kv_cache_bytes",), _as(fmt.nbytes, "kv_cache_bytes")),
    Column("cache analytic", ("kv_cache_bytes_model",), _as(fmt.nbytes, "kv_cache_bytes_model")),
    Column("cache ÷ analytic", ("ratio_kv_cache_bytes",), _as(fmt.ratio, "ratio_kv_cache_bytes")),
    Column("peak memory", ("peak_memory_bytes",), _as(fmt.nbytes, "peak_memory_bytes")),
    Column("peak predicted", ("peak_memory_predicted_bytes",), _as(fmt.nbytes, "peak_memory_predicted_bytes")),
    Column("peak ÷ predicted", ("ratio_peak_memory_bytes",), _as(fmt.ratio, "ratio_peak_memory_bytes")),
    Column("tokens/s", ("tokens_per_s",), lambda row: fmt.number(_get(row, "tokens_per_s"))),
    Column("bound", ("roof_bound",), lambda row: str(_get(row, "roof_bound") or "–"), False),
    Column("noisy", ("noisy", "noise_reason"),
           lambda row: str(_get(row, "noise_reason") or "–") if _get(row, "noisy") is True else "–", False),
]
ROW_IDENTITY = ("point_key", "source_file")  # rows.csv only: which row, read from which file


def ran_in_order(table: pd.DataFrame) -> pd.DataFrame:
    """The rows the rows table holds: every row that ran (skipped and failed ones are listed apart, with
    their reasons), in the table's order."""
    ran = table[table["status"] == "ok"] if "status" in table else table
    return ran.sort_values(ROW_ORDER)


def rows_table(table: pd.DataFrame) -> Table:
    """The rows table as a reader sees it (ROW_COLUMNS' cells): measured and analytic time, bytes, cache
    bytes, peak memory against the memory model's, their ratios, the bound; columns empty in every row
    left out."""
    body = [[column.cell(row) for column in ROW_COLUMNS] for _, row in ran_in_order(table).iterrows()]
    return without_empty_columns(Table([c.header for c in ROW_COLUMNS], body, [c.right for c in ROW_COLUMNS]))


def rows_csv(table: pd.DataFrame) -> str:
    """rows.csv: the rows table's rows in its order, each column's sources as numbers under the row's
    own column names (docs/columns.md), then which row and file."""
    ran = ran_in_order(table)
    names = list(dict.fromkeys(source for column in ROW_COLUMNS for source in column.sources)) + list(ROW_IDENTITY)
    return ran[[c for c in names if c in ran]].to_csv(index=False)


def roofs_table(table: pd.DataFrame) -> Table:
    """Which roof each model/device/dtype was predicted with."""
    header = ["device", "device name", "dtype", "peak FLOP/s", "bandwidth", "ridge (FLOP/B)", "source"]
    body = []
    keys = ["device", "device_name", "dtype", "roof_flops_used", "roof_bandwidth_used", "roof_description"]
    if "roof_flops_used" not in table:  # no row could be predicted
        return Table(header, [], [False, False, False, True, True, True, False])
    present = table.dropna(subset=["roof_flops_used"])
    for _, row in present[keys].drop_duplicates().iterrows():
        ridge = row["roof_flops_used"] / row["roof_bandwidth_used"]
        body.append([str(row["device"]), str(row["device_name"]), str(row["dtype"]),
                     fmt.rate(row["roof_flops_used"], "FLOP/s"), fmt.rate(row["roof_bandwidth_used"], "B/s"),
                     f"{ridge:.3g}", str(row["roof_description"])])
    return Table(header, body, [False, False, False, True, True, True, False])


def not_measured_table(table: pd.DataFrame) -> Table:
    """Skipped and failed rows with their reasons."""
    rows = table[table["status"] != "ok"].sort_values(ROW_ORDER) if "status" in table else table
    body = [[str(r["status"]), str(r[SERIES]), str(r["model"]), str(r["dtype"]), str(r["device"]),
             fmt.count(r["batch"]), fmt.count(r["ctx"]), str(_get(r, "reason") or "(no reason recorded)")]
            for _, r in rows.iterrows()]
    return Table(["status", "strategy", "model", "dtype", "device", "batch", "ctx", "reason"], body,
                 [False] * 5 + [True, True, False])


def unpredicted_table(rows: pd.DataFrame) -> Table:
    """Rows the analytic model could not predict, with its reason (harness.analysis.results.load)."""
    body = [[str(r["status"]), str(r[SERIES]), str(r["model"]), str(r["dtype"]), str(r["device"]),
             fmt.count(r["batch"]), fmt.count(r["ctx"]), str(_get(r, "roof_description") or "–")]
            for _, r in rows.sort_values(ROW_ORDER).iterrows()]
    return Table(["status", "strategy", "model", "dtype", "device", "batch", "ctx", "why"], body,
                 [False] * 5 + [True, True, False])


def skipped_files_table(skipped: list[tuple[str, str]]) -> Table:
    return Table(["file", "why it was not read"], [[Path(path).name, reason] for path, reason in skipped])


def equal_product_sets(ok: pd.DataFrame) -> list[tuple[int, pd.DataFrame]]:
    """Sets of ok rows of one cached strategy sharing batch x ctx (at least two batch sizes; one row per
    point, the newest), largest product first. Prefers the plainest cache (groups.plain_cache_strategy) when several qualify."""
    cached = cached_rows(ok).dropna(subset=["decode_step_s"])
    plain = plain_cache_strategy(cached)
    for strategy in [plain, *sorted(set(cached[SERIES]) - {plain})] if plain else []:
        rows = newest_per_point(cached[cached[SERIES] == strategy], ["batch", "ctx"])  # repeats: the newest
        rows = rows.assign(product=rows["batch"] * rows["ctx"])
        sets = [(int(p), g.sort_values("batch", ascending=False))
                for p, g in rows.groupby("product") if g["batch"].nunique() >= 2]
        if sets:
            return sorted(sets, key=lambda s: -s[0])
    return []


def equal_product_table(sets: list[tuple[int, pd.DataFrame]]) -> Table:
    header = ["batch × ctx", "batch", "ctx", "cache at batch×ctx (analytic)", "cache allocated",
              "peak memory", "step measured", "tokens/s measured", "tokens/s roofline"]
    body = []
    for product, rows in sets:
        for _, r in rows.iterrows():
            at_ctx = r["kv_cache_bytes_model"] // (r["ctx"] + r["decode_tokens"]) * r["ctx"]  # exact integers
            body.append([f"{product:,}", fmt.count(r["batch"]), fmt.count(r["ctx"]),
                         f"{fmt.count(at_ctx)} B", fmt.nbytes(r["kv_cache_bytes"]),
                         fmt.nbytes(_get(r, "peak_memory_bytes")), fmt.seconds(r["decode_step_s"]),
                         fmt.number(r["tokens_per_s"]), fmt.number(r["predicted_tokens_per_s"])])
    return Table(header, body, [True] * len(header))

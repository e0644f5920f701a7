"""The report's tables: every row beside its prediction, the roofs used, rows and files not measured."""
from __future__ import annotations

from pathlib import Path

import pandas as pd

from harness.report import units as fmt
from harness.report.document import Table
from harness.report.cohorts import cached_rows, plain_cache_strategy, SERIES

ROW_ORDER = ["model", "device", "dtype", SERIES, "batch", "ctx"]


def _get(row, key):
    return row[key] if key in row.index else None


def without_empty_columns(block: Table) -> Table:
    """The table without the columns that are empty ("–") in every row (e.g. counters a CPU lacks)."""
    keep = [i for i in range(len(block.header)) if any(row[i] not in ("–", "", "None") for row in block.rows)]
    right = block.align_right or [False] * len(block.header)
    return Table([block.header[i] for i in keep], [[row[i] for i in keep] for row in block.rows], [right[i] for i in keep])


def rows_table(table: pd.DataFrame) -> Table:
    """Every row that ran (skipped and failed ones are listed apart, with their reasons): measured and
    analytic time, bytes, cache bytes, peak memory against the memory model's, their ratios, the bound;
    columns empty in every row left out."""
    table = table[table["status"] == "ok"] if "status" in table else table
    header = ["strategy", "model", "dtype", "device", "batch", "ctx", "status",
              "step measured", "step roofline", "step ÷ roofline", "prefill measured", "prefill roofline",
              "prefill ÷ roofline", "bytes/step (source)", "bytes/step analytic", "bytes ÷ analytic",
              "cache allocated", "cache analytic", "cache ÷ analytic", "peak memory", "peak predicted",
              "peak ÷ predicted", "tokens/s", "bound", "noisy"]
    right = [False, False, False, False, True, True, False] + [True] * 16 + [False, False]
    body = []
    for _, row in table.sort_values(ROW_ORDER).iterrows():
        measured_bytes = _get(row, "bytes_per_step_measured")
        if fmt.missing(measured_bytes):
            bytes_cell = f"{fmt.nbytes(_get(row, 'bytes_per_step_model'))} (model)"
        else:
            bytes_cell = f"{fmt.nbytes(measured_bytes)} ({_get(row, 'traffic_source') or 'measured'})"
        body.append([
            str(row[SERIES]), str(row["model"]), str(row["dtype"]), str(row["device"]),
            fmt.count(row["batch"]), fmt.count(row["ctx"]), str(row["status"]),
            fmt.seconds(_get(row, "decode_step_s")), fmt.seconds(_get(row, "predicted_step_s")),
            fmt.ratio(_get(row, "ratio_decode_step_s")),
            fmt.seconds(_get(row, "prefill_s")), fmt.seconds(_get(row, "predicted_prefill_s")),
            fmt.ratio(_get(row, "ratio_prefill_s")),
            bytes_cell, fmt.nbytes(_get(row, "bytes_per_step_model")),
            fmt.ratio(_get(row, "ratio_bytes_per_step_measured")),  # only a counter's bytes make a ratio
            fmt.nbytes(_get(row, "kv_cache_bytes")), fmt.nbytes(_get(row, "kv_cache_bytes_model")),
            fmt.ratio(_get(row, "ratio_kv_cache_bytes")),
            fmt.nbytes(_get(row, "peak_memory_bytes")), fmt.nbytes(_get(row, "peak_memory_predicted_bytes")),
            fmt.ratio(_get(row, "ratio_peak_memory_bytes")),
            fmt.number(_get(row, "tokens_per_s")),
            str(_get(row, "roof_bound") or "–"),
            str(_get(row, "noise_reason") or "–") if _get(row, "noisy") is True else "–",
        ])
    return without_empty_columns(Table(header, body, right))


# rows.csv: the rows table's data, unformatted, under the columns' own names (docs/columns.md, docs/report.md)
ROWS_CSV_COLUMNS = [SERIES, "strategy", "model", "dtype", "device", "batch", "ctx", "status", "decode_step_s",
                    "predicted_step_s", "ratio_decode_step_s", "prefill_s", "predicted_prefill_s", "ratio_prefill_s",
                    "bytes_per_step_measured", "traffic_source", "bytes_per_step_model", "ratio_bytes_per_step_measured",
                    "kv_cache_bytes", "kv_cache_bytes_model", "ratio_kv_cache_bytes", "peak_memory_bytes",
                    "peak_memory_predicted_bytes", "ratio_peak_memory_bytes", "tokens_per_s", "roof_bound", "noisy",
                    "noise_reason", "point_key", "source_file"]


def rows_csv(table: pd.DataFrame) -> str:
    """rows.csv: every row that ran, the same rows as rows_table in its order, as numbers."""
    ran = table[table["status"] == "ok"].sort_values(ROW_ORDER)
    return ran[[c for c in ROWS_CSV_COLUMNS if c in ran]].to_csv(index=False)


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
    """Sets of ok rows of one cached strategy sharing batch x ctx (at least two batch sizes), largest
    product first. Prefers the plainest cache (groups.plain_cache_strategy) when several qualify."""
    cached = cached_rows(ok).dropna(subset=["decode_step_s"])
    plain = plain_cache_strategy(cached)
    for strategy in [plain, *sorted(set(cached[SERIES]) - {plain})] if plain else []:
        rows = cached[cached[SERIES] == strategy].copy()
        rows["product"] = rows["batch"] * rows["ctx"]
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

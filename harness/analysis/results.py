"""Read a results folder into one DataFrame: every row brought to today's schema, with its predictions.

    df = harness.analysis.results.load("results")
    df[["strategy", "ctx", "decode_step_s", "predicted_step_s", "ratio_decode_step_s"]]
    df.attrs["skipped_files"]  # [(path, reason), ...]: corrupt or foreign files, not read
    df.attrs["duplicates"]  # [(point_key, files), ...]: one point read from several files, kept once

Every `*.parquet` file at the top level of the folder is read and checked on its own, so one corrupt or
foreign file is named and skipped instead of failing the whole read (harness.analysis.row_files, which
splits a folder of many files among processes). Names starting with '_' or '.' (the report, Hydra's logs,
the calibration) are never rows. Rows of an older schema_version are brought up to date by
harness.store.upgrade.

The predictions (predicted_step_s, predicted_prefill_s, roof_bound, bytes and FLOPs per step, ...) are
the row's own columns, written by the run at its calibrated roofs (harness.analysis.predictions). This
module's one re-prediction step, `add_predictions`, fills them only where a row has none (no
calibration, or written before the columns existed), at a calibration file of the folder or a
datasheet; `load(..., datasheet=NAME)` predicts every row again at that datasheet's roofs ("what would
these rows be set against on an H100?"). The ratio columns (ratio_*) and roof_*_used are documented in
docs/report.md. `load` accepts several folders (rows of several hosts or devices) as one table.

`read_results` is what the report reads: the rows and the analytic tables drawn beside them
(harness.analysis.curves), in one call.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from harness.analysis.analytic import Roof
from harness.analysis.curves import AnalyticTables, analytic_tables
from harness.analysis.predictions import AT_A_ROOF, ROOF_FREE, predict
from harness.analysis.row_files import REQUIRED_COLUMNS, read_files
from harness.analysis.hardware import available_hardware, datasheet_for_device_name, load_hardware
from harness.config import CacheLayout
from harness.config.validate import ConfigError, first_line
from harness.store import calibration
from harness.store.recorded import layout_of, odd_points, shape_of
from harness.store.upgrade import upgrade

DEFAULT_FALLBACK_HARDWARE = "h100_sxm"  # datasheet used for rows with no calibration and no matching datasheet


@dataclass
class RowRoof:
    """The roof a row's prediction uses and where it came from."""

    roof: Roof  # peak FLOP/s and bandwidth
    source: str  # 'measured' | 'datasheet'
    description: str  # one line for the report: which calibration file or datasheet, and why


def read_rows(results_dir, left_out: tuple[str, ...] = ()) -> tuple[pd.DataFrame, list[tuple[str, str]]]:
    """All rows of the folder's Parquet files, as written (harness.store.upgrade brings them up to
    date), and the entries that were not read (path, reason). The files are read as one Arrow table
    (harness.analysis.row_files: in several processes for a folder of many), converted to pandas once:
    a folder of thousands of one-row files reads in seconds rather than minutes. `left_out`: columns
    not read (see load)."""
    table, skipped = read_files(results_dir, left_out)
    if table is None:
        return pd.DataFrame(columns=[*REQUIRED_COLUMNS, "source_file"]), skipped
    return table.to_pandas(), skipped


def roof_for_row(row, results_dir, fallback: str = DEFAULT_FALLBACK_HARDWARE) -> RowRoof:
    """Measured roofs where a calibration exists, a datasheet otherwise, in this order:
    the calibrated roofs recorded in the row (what it was judged against when it ran: a later
    recalibration does not rewrite it); a calibration file for the row's device and dtype (rows written
    before the runner recorded roofs); the datasheet matching a CUDA device name; the fallback
    datasheet (said to be a stand-in)."""
    dtype, device = str(row["dtype"]), str(row["device"])
    device_name = str(row.get("device_name") or "")
    bandwidth, flops = row.get("roof_bandwidth_Bps"), row.get("roof_flops")
    if _present(bandwidth) and _present(flops):
        return RowRoof(Roof(float(flops), float(bandwidth)), "measured",
                       f"measured: calibrated roofs recorded in the rows ({device_name or device})")
    found = calibration.find(results_dir, dtype, device, device_name)
    if found is not None:
        path, record = found
        return RowRoof(Roof(record.matmul_flops, record.read_bandwidth_Bps), "measured",
                       f"measured: calibration {path.name} ({record.device_name or device}, {record.timestamp})")
    name = datasheet_for_device_name(device_name) if device == "cuda" else None
    reason = f"datasheet matching '{device_name}'"
    if name is None:
        name, reason = fallback, f"no calibration for {device_name or device} {dtype}: a stand-in, not this machine"
    hardware = load_hardware(name)
    return RowRoof(hardware.roof(dtype), "datasheet", f"datasheet {name} ({hardware.source}); {reason}")


def _present(value) -> bool:
    return value is not None and not pd.isna(value)


# What a prediction depends on beside the roof: the shape, the point, the length its accuracy pass scored
# and the cache layout's columns.
PREDICTION_INPUTS = ("model", "vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "head_dim",
                     "dtype", "batch", "ctx", "decode_tokens", "caches_kv", "accuracy_ctx", "accuracy_steps",
                     *(f"{CacheLayout.ROW_PREFIX}{field.name}" for field in dataclasses.fields(CacheLayout)))


def add_predictions(rows: pd.DataFrame, results_dir, fallback: str = DEFAULT_FALLBACK_HARDWARE,
                    datasheet: str | None = None) -> pd.DataFrame:
    """The loader's one re-prediction step: rows with roof_*_used, roof_source and roof_description, and
    their prediction columns (harness.analysis.predictions) filled where they have none, at the roof
    roof_for_row finds. `datasheet`: every row predicted again at that datasheet's roofs instead (the
    rows' own, measured predictions replaced). Then the ratio columns, measured / predicted."""
    rows = rows.reset_index(drop=True)
    odd = odd_points(rows)  # a point no run accepts (ctx 0, a negative batch): no prediction, whatever it recorded
    recorded = (rows["predicted_step_s"].notna() & rows["roof_flops"].notna() & rows["roof_bandwidth_Bps"].notna()
                & (odd == ""))
    if datasheet is not None:
        recorded[:] = False
    # A row written before a roof-free column existed (harness.store.upgrade leaves it null) gets it here, at
    # its recorded roof, its own figures kept. kv_bytes_per_token is null only in such rows, and so is
    # accuracy_kv_bytes_per_token_held in a cached row whose accuracy pass ran.
    scored = rows["accuracy_ctx"].notna() & rows["accuracy_steps"].notna() & rows["caches_kv"].fillna(False).astype(bool)
    lacking = rows["kv_bytes_per_token"].isna() | (scored & rows["accuracy_kv_bytes_per_token_held"].isna())
    rows["roof_flops_used"] = rows["roof_flops"].where(recorded)
    rows["roof_bandwidth_used"] = rows["roof_bandwidth_Bps"].where(recorded)
    rows["roof_source"] = pd.Series("measured", index=rows.index, dtype=object).where(recorded)
    names = rows["device_name"].where(rows["device_name"].fillna("") != "", rows["device"]).astype(str)
    rows["roof_description"] = ("measured: calibrated roofs recorded in the rows (" + names + ")").where(recorded)
    roofs: dict = {}  # a row's roof depends on these alone: found once per kind of row
    figures_of: dict = {}  # (kind, PREDICTION_INPUTS) -> its prediction
    predicted, failed = {}, {}
    serving = rows["workload"].notna()  # a serving run (harness.serve) has no decode step to predict
    for index in rows.index[(~recorded | lacking) & ~serving]:
        if odd[index]:
            failed[index] = {"roof_source": "none", "roof_description": f"no prediction: {odd[index]}"}
            continue
        row = rows.loc[index]
        folder = row.get("source_dir", results_dir)
        try:
            kind = (folder, row["dtype"], row["device"], row["device_name"],
                    *(float(row[c]) if _present(row[c]) else None for c in ("roof_flops", "roof_bandwidth_Bps")))
            if kind not in roofs:
                roofs[kind] = (RowRoof(load_hardware(datasheet).roof(str(row["dtype"])), "datasheet",
                                       f"datasheet {datasheet}, asked for") if datasheet else
                               roof_for_row(row, folder, fallback))
            row_roof = roofs[kind]
            point = (kind, *(None if not _present(row[c]) else row[c] for c in PREDICTION_INPUTS))
            if point not in figures_of:  # repeats and copies of one point are predicted once
                scored_tokens = int(row["accuracy_ctx"] + row["accuracy_steps"]) if scored[index] else None
                figures_of[point] = predict(shape_of(row), str(row["dtype"]), int(row["batch"]), int(row["ctx"]),
                                            int(row["decode_tokens"]), layout_of(row), row_roof.roof, scored_tokens)
            figures = figures_of[point]
        except Exception as error:  # noqa: BLE001 - a row of any writer: what cannot be predicted is said, one row
            failed[index] = {"roof_source": "none", "roof_description": f"no prediction: {first_line(error, typed=False)}"}
            continue
        # A row's own figures stand: its roof-free ones, and at its recorded roof its predictions too.
        own = {c: row[c] for c in ROOF_FREE + (AT_A_ROOF if recorded[index] else ()) if _present(row[c])}
        predicted[index] = {**figures, **own, "roof_flops_used": row_roof.roof.flops_per_s,
                            "roof_bandwidth_used": row_roof.roof.bytes_per_s, "roof_source": row_roof.source,
                            "roof_description": row_roof.description}
    for found in (predicted, failed):  # written in one assignment per column: a row at a time is slow
        if found:
            found = pd.DataFrame.from_dict(found, orient="index")
            for column in found.columns:
                rows[column] = rows[column].astype(object)
                rows.loc[found.index, column] = found[column]
    for column in AT_A_ROOF + ROOF_FREE:
        if column != "roof_bound":  # bytes, FLOPs and seconds: a foreign row's infinity or negative is no figure
            values = pd.to_numeric(rows[column], errors="coerce")
            plain = values.astype(float)
            rows[column] = values.mask(values.notna() & ~(np.isfinite(plain) & (plain >= 0)))
    rows["predicted_tokens_per_s"] = rows["batch"] / rows["predicted_step_s"].where(rows["predicted_step_s"] > 0)
    for measured, predicted in RATIOS:
        rows[f"ratio_{measured}"] = _ratio(rows[measured], rows[predicted])
    return rows


def _ratio(measured: pd.Series, predicted: pd.Series) -> pd.Series:
    """measured / predicted, NaN where either is missing or the prediction is 0."""
    measured = pd.to_numeric(measured, errors="coerce")
    predicted = pd.to_numeric(predicted, errors="coerce").where(lambda s: s != 0)
    return measured / predicted


RATIOS = (  # measured / predicted: ratio_<measured column>
    ("decode_step_s", "predicted_step_s"),
    ("prefill_s", "predicted_prefill_s"),
    ("tokens_per_s", "predicted_tokens_per_s"),
    ("kv_cache_bytes", "kv_cache_bytes_model"),
    ("bytes_per_step_measured", "bytes_per_step_model"),
    ("peak_memory_bytes", "peak_memory_predicted_bytes"),  # the memory model (harness.analysis.peak_memory)
)


SERIES = "series"  # the column naming a strategy with the options that tell its rows apart
UNNAMED = "(unnamed)"  # the series of a row that names no strategy (odd_points: it is not predicted either)


def add_series(rows: pd.DataFrame) -> pd.DataFrame:
    """rows with a `series` column: the strategy's name, followed by the options that differ among the
    rows of that strategy, e.g. `quantized[format=int4]` beside `quantized[format=int8]`, and plain
    `paged` when every paged row has the same block size; `hugepages` counts as such an option (a sweep
    over hugepages=true,false draws each layout on each page size). Plots and tables draw one line per
    series."""
    if "strategy" not in rows or rows.empty:
        return rows.assign(**{SERIES: rows.get("strategy")})
    options = rows.get("strategy_options", pd.Series("{}", index=rows.index)).fillna("{}").map(options_of)
    if "hugepages" in rows:  # a run option that changes what a layout costs (scattered blocks, page walks)
        options = pd.Series([{**option, "hugepages": bool(huge)} for option, huge in
                             zip(options, rows["hugepages"].fillna(False))], index=rows.index)
    named = rows["strategy"].notna() & (rows["strategy"].astype(object) != "")
    labels = rows["strategy"].astype(object).where(named, UNNAMED).astype(str)  # a foreign row may name none
    for name, mine in options.groupby(rows["strategy"]):
        keys = sorted({key for option in mine for key in option})
        varying = [k for k in keys if len({json.dumps(option.get(k)) for option in mine}) > 1]
        if varying:
            labels[mine.index] = [f"{name}[{','.join(f'{k}={option.get(k)}' for k in varying)}]" for option in mine]
    return rows.assign(**{SERIES: labels})


def options_of(text) -> dict:
    """A row's strategy_options as a dict; {} where they are not a JSON object (a foreign writer's row:
    odd_points names it, and add_predictions leaves it unpredicted)."""
    try:
        options = json.loads(text)
    except (TypeError, ValueError, RecursionError):
        return {}
    return options if isinstance(options, dict) else {}


def dedupe(rows: pd.DataFrame) -> tuple[pd.DataFrame, list[tuple[str, list[str]]]]:
    """One row per written measurement: a row read twice (a copied file, a folder given twice) is kept
    once, its first copy; (point_key, the files it was read from) for each such point. Repeats and
    re-runs of a point are different rows (their timestamps differ) and all stay."""
    if rows.empty or "point_key" not in rows:
        return rows, []
    same = ["point_key", "timestamp"]
    twice = rows[rows.duplicated(same, keep=False) & rows["point_key"].notna()]
    found = [(str(key), sorted(f"{d}/{f}" for d, f in zip(copies["source_dir"], copies["source_file"])))
             for key, copies in twice.groupby("point_key", sort=True)]
    keep = ~rows.duplicated(same, keep="first") | rows["point_key"].isna()
    return rows[keep].reset_index(drop=True), found


def load(results_dir, fallback_hardware: str = DEFAULT_FALLBACK_HARDWARE, datasheet: str | None = None,
         left_out: tuple[str, ...] = ()) -> pd.DataFrame:
    """Every row of one folder, or of several (a list: rows of several hosts and devices), upgraded to
    today's schema, read once each, with its predictions (add_predictions; `datasheet`: all predicted
    again at that datasheet's roofs). `left_out`: columns the caller never reads, left in the files (in a
    one-row file every column costs about as much to decode as the next); they read as null, as a column
    an older row lacks does (harness.store.upgrade).

    attrs: skipped_files [(path, reason)], duplicates [(point_key, [files])],
    calibration_problems [(path, reason)], results_dir.
    """
    folders = [results_dir] if isinstance(results_dir, (str, Path)) else list(results_dir)
    frames, skipped, problems = [], [], []
    for folder in folders:
        rows, not_rows = read_rows(folder, left_out)
        frames.append(rows.assign(source_dir=str(folder)))
        skipped += not_rows
        problems += [(str(p), why) for p, why in calibration.read_all(folder)[1]]
    frames = [frame for frame in frames if len(frame)] or frames[:1]
    rows, duplicates = dedupe(upgrade(pd.concat(frames, ignore_index=True) if len(frames) > 1 else frames[0]))
    rows = add_series(rows)
    table = add_predictions(rows, folders[0], fallback_hardware, datasheet) if len(rows) else rows
    table.attrs["skipped_files"] = skipped
    table.attrs["duplicates"] = duplicates
    table.attrs["calibration_problems"] = problems
    table.attrs["results_dir"] = ", ".join(str(f) for f in folders)
    return table


@dataclass
class Results:
    """What a report reads of a results folder: its rows, and the analytic tables it draws beside them."""

    rows: pd.DataFrame  # load's table (its attrs: the files not read, the rows read twice, ...)
    tables: AnalyticTables  # what lies between and beyond the rows (harness.analysis.curves)

    @classmethod
    def of(cls, rows: pd.DataFrame) -> "Results":
        """A loaded table of rows (load's, or a selection of it) with its tables."""
        return cls(rows, analytic_tables(rows))


def read_results(results_dir, fallback_hardware: str = DEFAULT_FALLBACK_HARDWARE,
                 left_out: tuple[str, ...] = ()) -> Results:
    """The loader's whole answer for a report: load's rows and analytic_tables of them. ConfigError on
    `hardware`, before anything is read, when `fallback_hardware` names no datasheet."""
    datasheets = [name for name in available_hardware() if name != "measured"]
    if fallback_hardware not in datasheets:
        raise ConfigError("hardware", f"unknown datasheet '{fallback_hardware}', allowed: {', '.join(datasheets)}")
    return Results.of(load(results_dir, fallback_hardware, left_out=left_out))

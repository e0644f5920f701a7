"""Read a results folder into one DataFrame, every row joined with its analytic prediction.

    df = harness.analysis.results.load("results")
    df[["strategy", "ctx", "decode_step_s", "analytic_decode_step_s", "ratio_decode_step_s"]]
    df.attrs["skipped_files"]  # [(path, reason), ...]: corrupt or foreign files, not read

Each `*.parquet` file at the top level of the folder is read on its own, so one corrupt or foreign file
is named and skipped instead of failing the whole read (`pandas.read_parquet(folder)` would raise).
Names starting with '_' or '.' (the report, Hydra's logs, the calibration) are never rows.

The analytic columns (analytic_*, ratio_*, roof_*) are documented in docs/report.md. `load` accepts
several folders (rows of several hosts or devices) and reads them as one table.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import pyarrow.parquet as pq

from harness.analysis import analytic
from harness.analysis.analytic import Roof
from harness.analysis.hardware import HardwareError, datasheet_for_device_name, load_hardware
from harness.config import CacheLayout, ModelConfig
from harness.config.validate import first_line
from harness.store import calibration

# Columns a file must have to be read as a harness row (the rest may be missing in older rows).
REQUIRED_COLUMNS = (
    "strategy", "model", "vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim",
    "ffn_dim", "dtype", "device", "batch", "ctx", "decode_tokens", "status",
)
DEFAULT_FALLBACK_HARDWARE = "h100_sxm"  # datasheet used for rows with no calibration and no matching datasheet


@dataclass
class RowRoof:
    """The roof a row's prediction uses and where it came from."""

    roof: Roof  # peak FLOP/s and bandwidth
    source: str  # 'measured' | 'datasheet'
    description: str  # one line for the report: which calibration file or datasheet, and why


def read_rows(results_dir) -> tuple[pd.DataFrame, list[tuple[str, str]]]:
    """All rows of the folder's Parquet files, and the entries that were not read (path, reason)."""
    folder = Path(results_dir)
    frames, skipped = [], []
    for path in sorted(folder.iterdir()) if folder.is_dir() else []:
        if path.name.startswith(("_", ".")):
            continue
        if path.is_dir():
            skipped.append((str(path), "a folder: not read (pandas.read_parquet on the results folder would read it as a partition)"))
            continue
        if path.suffix != ".parquet":
            skipped.append((str(path), "not a .parquet file (pandas.read_parquet on the results folder will fail on it)"))
            continue
        try:
            frame = pq.read_table(path).to_pandas()
        except Exception as error:  # pyarrow raises several types for a damaged file
            skipped.append((str(path), f"corrupt Parquet: {first_line(error, typed=False)}"))
            continue
        missing = [c for c in REQUIRED_COLUMNS if c not in frame.columns]
        if missing:
            skipped.append((str(path), f"not a harness row: missing columns {', '.join(missing)}"))
            continue
        frame["source_file"] = path.name
        frames.append(frame)
    rows = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=[*REQUIRED_COLUMNS, "source_file"])
    return rows, skipped


def shape_of(row) -> ModelConfig:
    """The decoder shape recorded in a row."""
    return ModelConfig(
        name=str(row["model"]),
        vocab_size=int(row["vocab_size"]),
        d_model=int(row["d_model"]),
        n_layers=int(row["n_layers"]),
        n_heads=int(row["n_heads"]),
        n_kv_heads=int(row["n_kv_heads"]),
        ffn_dim=int(row["ffn_dim"]),
        head_dim=int(row["head_dim"]),
    )


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


def layout_of(row) -> CacheLayout | None:
    """The cache layout recorded in a row's cache_* columns (None: the strategy keeps no cache)."""
    if "caches_kv" in row.index and not _present(row["caches_kv"]):
        return None
    if "caches_kv" in row.index and not bool(row["caches_kv"]):
        return None
    values = {}
    for field in dataclasses.fields(CacheLayout):
        column = f"{CacheLayout.ROW_PREFIX}{field.name}"
        if column in row.index and _present(row[column]):
            values[field.name] = type(field.default)(row[column])
    return CacheLayout(**values)


def predict_row(row, roof: Roof) -> dict:
    """The analytic figures for one row at `roof`, per decode step averaged over the row's decode steps
    (the runner times steps ctx .. ctx + decode_tokens - 1; without a cache each is one full
    recompute). The roof-free figures (bytes, FLOPs, cache bytes) are the row's own `*_model` columns,
    computed again here only for rows that lack them."""
    shape, dtype, layout = shape_of(row), str(row["dtype"]), layout_of(row)
    batch, ctx, steps = int(row["batch"]), int(row["ctx"]), max(int(row["decode_tokens"]), 1)
    step = analytic.mean_decode_step(shape, dtype, batch, ctx, steps, layout, roof)
    return {
        "weight_bytes": analytic.weight_bytes(shape, dtype),
        "kv_cache_bytes_model": analytic.kv_cache_bytes(shape, dtype, batch, ctx + steps, layout),
        "bytes_per_step_model": step.bytes,
        "flops_per_step_model": step.flops,
        "roof_bound": analytic.bound(step.flops, step.bytes, roof),
        "analytic_intensity_flops_per_byte": step.flops / step.bytes,
        "analytic_decode_step_s": step.seconds,
        "analytic_tokens_per_s": batch / step.seconds,
        "analytic_prefill_s": analytic.prefill_time(shape, dtype, batch, ctx, roof, layout),
    }


def _ratio(measured: pd.Series, predicted: pd.Series) -> pd.Series:
    """measured / predicted, NaN where either is missing or the prediction is 0."""
    measured = pd.to_numeric(measured, errors="coerce")
    predicted = pd.to_numeric(predicted, errors="coerce").where(lambda s: s != 0)
    return measured / predicted


RATIOS = (  # measured / analytic
    ("decode_step_s", "analytic_decode_step_s"),
    ("prefill_s", "analytic_prefill_s"),
    ("tokens_per_s", "analytic_tokens_per_s"),
    ("kv_cache_bytes", "kv_cache_bytes_model"),
    ("bytes_per_step_measured", "bytes_per_step_model"),
    ("peak_memory_bytes", "peak_memory_predicted_bytes"),  # the memory model (harness.analysis.peak_memory)
)


def add_analytic_columns(rows: pd.DataFrame, results_dir, fallback: str = DEFAULT_FALLBACK_HARDWARE) -> pd.DataFrame:
    """rows with analytic_*, ratio_* and roof_*_used columns joined (see the module docstring); the
    row's own model columns and roof_bound are filled where the row lacks them."""
    extra = []
    for _, row in rows.iterrows():
        folder = row.get("source_dir", results_dir)
        try:
            row_roof = roof_for_row(row, folder, fallback)
            figures = predict_row(row, row_roof.roof)
        except (HardwareError, ValueError, TypeError, ZeroDivisionError) as error:
            extra.append({"roof_source": "none", "roof_description": f"no prediction: {first_line(error, typed=False)}"})
            continue
        extra.append({
            **figures,
            "roof_flops_used": row_roof.roof.flops_per_s,
            "roof_bandwidth_used": row_roof.roof.bytes_per_s,
            "roof_source": row_roof.source,
            "roof_description": row_roof.description,
        })
    predicted = pd.DataFrame(extra, index=range(len(rows)))
    joined = rows.reset_index(drop=True)
    for column in predicted.columns:
        if column in joined:  # the row's own figure stands; the prediction fills only what it lacks
            joined[column] = joined[column].where(joined[column].notna(), predicted[column])
        else:
            joined[column] = predicted[column]
    for measured, analytic_column in RATIOS:
        if measured in joined and analytic_column in joined:
            joined[f"ratio_{measured}"] = _ratio(joined[measured], joined[analytic_column])
    return joined


SERIES = "series"  # the column naming a strategy with the options that tell its rows apart


def add_series(rows: pd.DataFrame) -> pd.DataFrame:
    """rows with a `series` column: the strategy's name, followed by the options that differ among the
    rows of that strategy, e.g. `quantized[format=int4]` beside `quantized[format=int8]`, and plain
    `paged` when every paged row has the same block size; `hugepages` counts as such an option (a sweep
    over hugepages=true,false draws each layout on each page size). Plots and tables draw one line per
    series."""
    if "strategy" not in rows or rows.empty:
        return rows.assign(**{SERIES: rows.get("strategy")})
    options = rows.get("strategy_options", pd.Series("{}", index=rows.index)).fillna("{}").map(json.loads)
    if "hugepages" in rows:  # a run option that changes what a layout costs (scattered blocks, page walks)
        pages = rows["hugepages"].fillna(False).astype(bool)  # rows written before the column: default pages
        options = pd.Series([{**option, "hugepages": bool(huge)} for option, huge in zip(options, pages)],
                            index=rows.index)
    labels = rows["strategy"].astype(str).copy()
    for name, mine in options.groupby(rows["strategy"]):
        keys = sorted({key for option in mine for key in option})
        varying = [k for k in keys if len({json.dumps(option.get(k)) for option in mine}) > 1]
        if varying:
            labels[mine.index] = [f"{name}[{','.join(f'{k}={option.get(k)}' for k in varying)}]" for option in mine]
    return rows.assign(**{SERIES: labels})


def load(results_dir, fallback_hardware: str = DEFAULT_FALLBACK_HARDWARE) -> pd.DataFrame:
    """Every row of one folder, or of several (a list: rows of several hosts and devices), with the
    analytic columns joined.

    attrs: skipped_files [(path, reason)], calibration_problems [(path, reason)], results_dir.
    """
    folders = [results_dir] if isinstance(results_dir, (str, Path)) else list(results_dir)
    frames, skipped, problems = [], [], []
    for folder in folders:
        rows, not_rows = read_rows(folder)
        frames.append(rows.assign(source_dir=str(folder)))
        skipped += not_rows
        problems += [(str(p), why) for p, why in calibration.read_all(folder)[1]]
    rows = add_series(pd.concat(frames, ignore_index=True) if len(frames) > 1 else frames[0])
    table = add_analytic_columns(rows, folders[0], fallback_hardware) if len(rows) else rows
    table.attrs["skipped_files"] = skipped
    table.attrs["calibration_problems"] = problems
    table.attrs["results_dir"] = ", ".join(str(f) for f in folders)
    return table

"""Read a results folder into one DataFrame, every row joined with its analytic prediction.

    df = harness.results.load("results")
    df[["strategy", "ctx", "decode_step_s", "analytic_decode_step_s", "ratio_decode_step_s"]]
    df.attrs["skipped_files"]  # [(path, reason), ...]: corrupt or foreign files, not read

Each `*.parquet` file at the top level of the folder is read on its own, so one corrupt or foreign file
is named and skipped instead of failing the whole read (`pandas.read_parquet(folder)` would raise).
Names starting with '_' or '.' (the report, Hydra's logs, the calibration) are never rows.

The analytic columns (analytic_*, ratio_*, roof_*) are documented in docs/analytic_and_report.md.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import pyarrow.parquet as pq

from harness import analytic
from harness.analytic import Roof
from harness.config import ModelConfig
from harness.hardware import (
    HardwareError,
    datasheet_for_device_name,
    find_calibration,
    load_hardware,
    read_calibrations,
)

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
            skipped.append((str(path), f"corrupt Parquet: {_first_line(error)}"))
            continue
        missing = [c for c in REQUIRED_COLUMNS if c not in frame.columns]
        if missing:
            skipped.append((str(path), f"not a harness row: missing columns {', '.join(missing)}"))
            continue
        frame["source_file"] = path.name
        frames.append(frame)
    rows = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=[*REQUIRED_COLUMNS, "source_file"])
    return rows, skipped


def _first_line(error: Exception) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


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
    record = find_calibration(results_dir, dtype, device, device_name)
    if record is not None:
        return RowRoof(Roof(record.matmul_flops, record.read_bandwidth_Bps), "measured",
                       f"measured: calibration {record.path.name} ({record.device_name or device}, {record.timestamp})")
    name = datasheet_for_device_name(device_name) if device == "cuda" else None
    reason = f"datasheet matching '{device_name}'"
    if name is None:
        name, reason = fallback, f"no calibration for {device_name or device} {dtype}: a stand-in, not this machine"
    hardware = load_hardware(name)
    return RowRoof(hardware.roof(dtype), "datasheet", f"datasheet {name} ({hardware.source}); {reason}")


def _present(value) -> bool:
    return value is not None and not pd.isna(value)


def predict_row(row, roof: Roof) -> dict:
    """The analytic figures for one row, per decode step averaged over the row's decode steps (the
    runner times steps ctx .. ctx + decode_tokens - 1; for no_cache each is one full recompute)."""
    shape, dtype = shape_of(row), str(row["dtype"])
    batch, ctx, steps = int(row["batch"]), int(row["ctx"]), max(int(row["decode_tokens"]), 1)
    cached = str(row["strategy"]) != "no_cache"
    contexts = range(ctx, ctx + steps)
    step_bytes = sum(analytic.decode_step_bytes(shape, dtype, batch, c, cached)["total"] for c in contexts) / steps
    step_flops = analytic.generate_flops(shape, batch, ctx, steps, cached) / steps
    step_s = analytic.generate_time(shape, dtype, batch, ctx, steps, roof, cached) / steps
    cache_bytes = analytic.kv_cache_bytes(shape, dtype, batch, ctx + steps) if cached else 0
    return {
        "analytic_weight_bytes": analytic.weight_bytes(shape, dtype),
        "analytic_kv_cache_bytes": cache_bytes,
        "analytic_bytes_per_step": step_bytes,
        "analytic_flops_per_step": step_flops,
        "analytic_intensity_flops_per_byte": step_flops / step_bytes,
        "analytic_decode_step_s": step_s,
        "analytic_tokens_per_s": batch / step_s,
        "analytic_prefill_s": analytic.prefill_time(shape, dtype, batch, ctx, roof, cached),
        "analytic_bound": analytic.bound(step_flops, step_bytes, roof),
    }


def _ratio(measured: pd.Series, predicted: pd.Series) -> pd.Series:
    """measured / predicted, NaN where either is missing or the prediction is 0."""
    measured = pd.to_numeric(measured, errors="coerce")
    predicted = pd.to_numeric(predicted, errors="coerce").where(lambda s: s != 0)
    return measured / predicted


def add_analytic_columns(rows: pd.DataFrame, results_dir, fallback: str = DEFAULT_FALLBACK_HARDWARE) -> pd.DataFrame:
    """rows with analytic_*, ratio_* and roof_* columns joined (see the module docstring)."""
    extra = []
    for _, row in rows.iterrows():
        try:
            row_roof = roof_for_row(row, results_dir, fallback)
            figures = predict_row(row, row_roof.roof)
        except (HardwareError, ValueError, TypeError, ZeroDivisionError) as error:
            extra.append({"roof_source": "none", "roof_description": f"no prediction: {_first_line(error)}"})
            continue
        extra.append({
            **figures,
            "roof_flops_used": row_roof.roof.flops_per_s,
            "roof_bandwidth_used": row_roof.roof.bytes_per_s,
            "roof_source": row_roof.source,
            "roof_description": row_roof.description,
        })
    joined = pd.concat([rows.reset_index(drop=True), pd.DataFrame(extra, index=range(len(rows)))], axis=1)
    for measured, predicted in (
        ("decode_step_s", "analytic_decode_step_s"),
        ("prefill_s", "analytic_prefill_s"),
        ("tokens_per_s", "analytic_tokens_per_s"),
        ("kv_cache_bytes", "analytic_kv_cache_bytes"),
        ("bytes_per_step_model", "analytic_bytes_per_step"),
        ("bytes_per_step_measured", "analytic_bytes_per_step"),
    ):
        if measured in joined and predicted in joined:
            joined[f"ratio_{measured}"] = _ratio(joined[measured], joined[predicted])
    return joined


def load(results_dir, fallback_hardware: str = DEFAULT_FALLBACK_HARDWARE) -> pd.DataFrame:
    """Every row of the folder with the analytic columns joined.

    attrs: skipped_files [(path, reason)], calibration_problems [(path, reason)], results_dir.
    """
    rows, skipped = read_rows(results_dir)
    table = add_analytic_columns(rows, results_dir, fallback_hardware) if len(rows) else rows
    _, calibration_problems = read_calibrations(results_dir)
    table.attrs["skipped_files"] = skipped
    table.attrs["calibration_problems"] = [(str(p), why) for p, why in calibration_problems]
    table.attrs["results_dir"] = str(results_dir)
    return table

"""Assemble a row: the point's dataclasses flattened, what was measured, the analytic model at the
point, the roofs it is judged against, and the run's metadata. Every key is a column of
harness.store.columns, and every column is filled by exactly one of these parts."""
from __future__ import annotations

import dataclasses
import json
from datetime import datetime, timezone

from harness.analysis.analytic import Roof
from harness.analysis.predictions import ROOF_FREE, predict
from harness.analysis.peak_memory import predicted_peak_bytes
from harness.measure.contention import noise_reasons
from harness.config import CacheLayout, Point
from harness.config.point import COLUMN, NULL_COLUMNS_OF
from harness.run.metadata import run_metadata
from harness.store.columns import COLUMN_NAMES, COLUMNS_BY_SOURCE, SCHEMA_VERSION


def flatten(obj, prefix: str = "") -> dict:
    """A dataclass as flat columns: a field whose metadata names its column (COLUMN) takes that name, or
    none at all (NO_COLUMNS); a nested dataclass's fields take its class's ROW_PREFIX, its `name`
    field takes the name of the field holding it (model.name -> `model`), a None dataclass leaves its
    columns null, and a dict becomes JSON text."""
    row = {}
    for field in dataclasses.fields(obj):
        value = getattr(obj, field.name)
        if COLUMN in field.metadata:
            if field.metadata[COLUMN] is not None:
                row[field.metadata[COLUMN]] = value
        elif dataclasses.is_dataclass(value):
            row.update(_nested(value, field.name))
        elif value is None and field.name == "layout":  # no cache: the layout's columns stay null
            row.update({f"{CacheLayout.ROW_PREFIX}{f.name}": None for f in dataclasses.fields(CacheLayout)})
        elif value is None and NULL_COLUMNS_OF in field.metadata:  # e.g. a step row's serving columns
            row.update(dict.fromkeys(_nested(field.metadata[NULL_COLUMNS_OF](), field.name)))
        elif isinstance(value, dict):
            row[prefix + field.name] = json.dumps(value, sort_keys=True)
        else:
            row[prefix + field.name] = value
    return row


def _nested(value, holder: str) -> dict:
    prefix = getattr(type(value), "ROW_PREFIX", f"{holder}_")
    columns = flatten(value, prefix)
    if f"{prefix}name" in columns:
        columns[holder] = columns.pop(f"{prefix}name")
    return columns


def _predict(point: Point, roof: Roof | None) -> dict:
    return predict(point.model, point.dtype, point.batch, point.ctx, point.decode_tokens, point.strategy.layout, roof)


def model_columns(point: Point, outcome: dict) -> dict:
    """The analytic model at the point, roofs aside (harness.analysis.predictions), at the length its
    accuracy pass scored (`outcome`'s accuracy_ctx and accuracy_steps, where one ran), and the memory model."""
    scored = (outcome["accuracy_ctx"] + outcome["accuracy_steps"]
              if outcome.get("accuracy_ctx") is not None and outcome.get("accuracy_steps") is not None else None)
    figures = predict(point.model, point.dtype, point.batch, point.ctx, point.decode_tokens, point.strategy.layout,
                      scored_tokens=scored)
    return {**{k: v for k, v in figures.items() if k in ROOF_FREE}, "peak_memory_predicted_bytes": predicted_peak_bytes(point)}


def roof_columns(point: Point, row: dict, roofs) -> dict:
    """The roofs the row is judged against, what the analytic model predicts at them
    (predicted_step_s, predicted_prefill_s, roof_bound), and the fractions of them the measured step reached."""
    columns = dict.fromkeys(COLUMNS_BY_SOURCE["roofs"])
    if roofs is None:
        return columns
    columns.update(roof_bandwidth_Bps=roofs.read_bandwidth_Bps, roof_flops=roofs.matmul_flops,
                   roof_bandwidth_gemv_Bps=roofs.gemv_bandwidth_Bps)
    predicted = _predict(point, Roof(flops_per_s=roofs.matmul_flops, bytes_per_s=roofs.read_bandwidth_Bps))
    columns.update({k: predicted[k] for k in ("predicted_step_s", "predicted_prefill_s", "roof_bound")})
    step_bytes, step_flops = row["bytes_per_step_model"], row["flops_per_step_model"]
    if row["status"] == "ok":
        step = row["decode_step_s"]
        columns["bandwidth_fraction"] = step_bytes / step / roofs.read_bandwidth_Bps
        columns["flops_fraction"] = step_flops / step / roofs.matmul_flops
        # The binding roof's fraction: how close the step came to what this machine allows at all. A
        # compute-bound step cannot reach a bandwidth fraction above ridge / intensity, however good.
        columns["roofline_fraction"] = predicted["predicted_step_s"] / step
        in_rounds = row["roof_bandwidth_in_rounds_Bps"]
        if in_rounds:  # the same step against the read the machine gave in the step's own rounds
            columns["bandwidth_fraction_in_rounds"] = step_bytes / step / in_rounds
            window = _predict(point, Roof(flops_per_s=roofs.matmul_flops, bytes_per_s=in_rounds))
            columns["roofline_fraction_in_rounds"] = window["predicted_step_s"] / step
    return columns


def noise_columns(row: dict) -> dict:
    """noisy and noise_reason of a row that ran (harness.measure.contention); null for one that did not."""
    if row["status"] != "ok":
        return {"noisy": None, "noise_reason": None}
    fractions = {name: row[name] for name in ("bandwidth_fraction", "flops_fraction")}
    in_rounds = row.get("bandwidth_fraction_in_rounds")
    if in_rounds is not None and fractions["bandwidth_fraction"] is not None:
        # A step that beats a best-of roof calibrated minutes earlier, but not the read its own rounds
        # timed, shows that roof stale, not the step wrong: the rounds' read says what the machine gave.
        fractions["bandwidth_fraction"] = min(fractions["bandwidth_fraction"], in_rounds)
    reasons = noise_reasons(row["contention"], row["decode_step_p10_s"], row["decode_step_p90_s"], fractions)
    return {"noisy": bool(reasons), "noise_reason": "; ".join(reasons)}


def build_row(point: Point, measured: dict, roofs=None, sweep_parallelism: int = 1) -> dict:
    """`measured`: measure_point's outcome (extra keys such as `tokens` are not columns and are
    dropped); `roofs`: a harness.store.calibration.Calibration for the point's device and dtype, or None."""
    outcome = {**dict.fromkeys(COLUMNS_BY_SOURCE["measured"]), "traffic_source": "model",
               **{k: v for k, v in measured.items() if k in COLUMNS_BY_SOURCE["measured"]}}
    if point.serving is not None:  # a serving run: no decode step to predict or set against a roof
        row = {**flatten(point), **outcome, **dict.fromkeys(COLUMNS_BY_SOURCE["model"]),
               **dict.fromkeys(COLUMNS_BY_SOURCE["roofs"]), "weight_bytes": model_columns(point, outcome)["weight_bytes"]}
        reasons = noise_reasons(row["contention"], None, None, {}) if row["status"] == "ok" else None
        row.update(noisy=None if reasons is None else bool(reasons), noise_reason=None if reasons is None else "; ".join(reasons))
    else:
        row = {**flatten(point), **outcome, **model_columns(point, outcome)}
        row.update(roof_columns(point, row, roofs))
        row.update(noise_columns(row))
    row.update(run_metadata(sweep_parallelism), schema_version=SCHEMA_VERSION, timestamp=datetime.now(timezone.utc), point_key=point.key,
               config_json=json.dumps(point.record(), sort_keys=True))
    if set(row) != set(COLUMN_NAMES):
        raise AssertionError(f"row and schema disagree: {sorted(set(row) ^ set(COLUMN_NAMES))}")
    return {name: row[name] for name in COLUMN_NAMES}

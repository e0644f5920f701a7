"""Assemble a row: the point's configuration, what was measured, the analytic model, run metadata."""
from __future__ import annotations

import json

from harness import analytic
from harness.metadata import run_metadata
from harness.points import Point
from harness.schema import COLUMN_NAMES


def step_contexts(point: Point) -> range:
    """Context (tokens before the fed one) of each timed decode step: ctx, ctx + 1, ..."""
    return range(point.ctx, point.ctx + point.decode_tokens)


def mean_step_bytes(point: Point, caches_kv: bool) -> int:
    """Bytes a decode step must move per the analytic model, averaged over the timed steps (the
    median time is set against the mean step: bytes grow linearly over the steps)."""
    per_step = [
        analytic.decode_step_bytes(point.model, point.dtype, point.batch, c, cached=caches_kv)["total"]
        for c in step_contexts(point)
    ]
    return round(sum(per_step) / len(per_step))


def mean_step_flops(point: Point, caches_kv: bool) -> float:
    per_step = [analytic.decode_step_flops(point.model, point.batch, c, cached=caches_kv) for c in step_contexts(point)]
    return sum(per_step) / len(per_step)


def roof_columns(row: dict, roofs) -> dict:
    """The roofs the row is judged against and the fractions of them the measured step reached."""
    if roofs is None:
        return {}
    columns = {"roof_bandwidth_Bps": roofs.read_bandwidth_Bps, "roof_flops": roofs.matmul_flops}
    step_bytes, step_flops = row["bytes_per_step_model"], row["flops_per_step_model"]
    roof = analytic.Roof(flops_per_s=roofs.matmul_flops, bytes_per_s=roofs.read_bandwidth_Bps)
    columns["roof_bound"] = analytic.bound(step_flops, step_bytes, roof)
    if row["status"] == "ok":
        step = row["decode_step_s"]
        columns["bandwidth_fraction"] = step_bytes / step / roofs.read_bandwidth_Bps
        columns["flops_fraction"] = step_flops / step / roofs.matmul_flops
        # The binding roof's fraction: how close the step came to what this machine allows at all. A
        # compute-bound step cannot reach a bandwidth fraction above ridge / intensity, however good.
        columns["roofline_fraction"] = analytic.roofline_time(step_flops, step_bytes, roof) / step
    return columns


def build_row(point: Point, measured: dict, caches_kv: bool, roofs=None) -> dict:
    """`roofs`: a harness.calibrate.Calibration for the point's device and dtype, or None."""
    shape = point.model
    row = {
        "strategy": point.strategy_name,
        "model": shape.name,
        "vocab_size": shape.vocab_size,
        "d_model": shape.d_model,
        "n_layers": shape.n_layers,
        "n_heads": shape.n_heads,
        "n_kv_heads": shape.n_kv_heads,
        "head_dim": shape.resolved_head_dim,
        "ffn_dim": shape.ffn_dim,
        "dtype": point.dtype,
        "device": point.device,
        "batch": point.batch,
        "ctx": point.ctx,
        "decode_tokens": point.decode_tokens,
        "prefill_mode": point.prefill,
        "weight_bytes": analytic.weight_bytes(shape, point.dtype),
        "bytes_per_step_model": mean_step_bytes(point, caches_kv),
        "flops_per_step_model": mean_step_flops(point, caches_kv),
        "bytes_per_step_measured": None,
        "traffic_source": "model",
        "seed": point.seed,
        "point_key": point.key,
        "config_json": json.dumps(point.identity(), sort_keys=True),
        **run_metadata(),
    }
    row.update({k: v for k, v in measured.items() if k in COLUMN_NAMES})
    row.update(roof_columns(row, roofs))
    return {name: row.get(name) for name in COLUMN_NAMES}

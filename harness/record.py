"""Assemble a row: the point's configuration, what was measured, the analytic model, run metadata."""
from __future__ import annotations

import json

from harness import analytic
from harness.metadata import run_metadata
from harness.points import Point
from harness.schema import COLUMN_NAMES


def mean_step_bytes(point: Point, caches_kv: bool) -> int:
    """Bytes per decode step from the analytic model, averaged over the timed steps.

    Timed step j (1-based) feeds the token at position ctx + j - 1 and reads the ctx + j - 1 cached
    tokens before it; bytes are linear in context, so the mean is the step at the mean context.
    """
    n = point.decode_tokens
    total = sum(
        analytic.decode_step_bytes(point.model, point.dtype, point.batch, point.ctx + j - 1, cached=caches_kv)["total"]
        for j in range(1, n + 1)
    )
    return round(total / n)


def build_row(point: Point, measured: dict, caches_kv: bool) -> dict:
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
        "bytes_per_step_measured": None,
        "traffic_source": "model",
        "seed": point.seed,
        "point_key": point.key,
        "config_json": json.dumps(point.identity(), sort_keys=True),
        **run_metadata(),
    }
    row.update({k: v for k, v in measured.items() if k in COLUMN_NAMES})
    return {name: row.get(name) for name in COLUMN_NAMES}

"""The analytic figures a report draws beside the rows that no single row holds, computed once, as data:
the predicted step along a grid of contexts (the plots' lines), the published shapes' table, and the
questions' example deployment (Llama 3 70B on an H100's datasheet).

What a figure says of one row is the row's own column, computed where the row is made (harness.run.row,
from harness.analysis.predictions; the loader fills it for rows written before it existed): its
prediction, its bytes per token held (at its own length and at its accuracy pass's), its shape's bytes per
token and the tokens that weigh as much as its weights. What lies between and beyond the rows is here:
`analytic_tables(rows)`, which the loader calls on the table it loaded
(harness.analysis.results.read_results). The report never calls the analytic model itself (an
import-linter contract says so).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd
import yaml

from harness.analysis import analytic
from harness.analysis.hardware import load_hardware
from harness.analysis.predictions import predict
from harness.config import ModelConfig, model_config_from
from harness.config.paths import config_dir
from harness.store.recorded import layout_of, shape_of

MODEL_DIR = config_dir() / "model"
LINE_KEYS = ["model", "dtype", "roof_flops_used", "roof_bandwidth_used"]  # what a line's numbers depend on, with series and batch


@dataclass
class AnalyticTables:
    """Everything analytic the report shows beyond the rows' own columns."""

    lines: pd.DataFrame  # LINE_KEYS, series, batch, ctx -> predicted_step_s, flops_per_step_model, prefill_bytes_per_token, decode_bytes_per_token, kv_cache_bytes_at_ctx
    published: pd.DataFrame  # every preset of conf/model/ in float32 and bfloat16: kv_bytes_per_token, weight_bytes, tokens_to_match_weights
    example: dict  # the questions' example deployment: named figures (see example_figures)


def context_grid(ctxs) -> np.ndarray:
    """Contexts for an analytic line spanning the measured ones, a little beyond each end, and the
    measured ones themselves (so a line can be read at a row's context)."""
    ctxs = [int(c) for c in ctxs]
    low, high = max(1, int(min(ctxs) / 1.5)), int(max(ctxs) * 1.5)
    return np.unique(np.concatenate([np.geomspace(low, high, 40).astype(int), ctxs]))


def _lines(rows: pd.DataFrame) -> pd.DataFrame:
    found = []
    predicted = rows[rows["roof_flops_used"].notna() & rows["roof_bandwidth_used"].notna()]
    for (model, dtype, flops, bandwidth), mine in predicted.groupby(LINE_KEYS, sort=False):
        try:
            found += _lines_at_a_roof(mine, model, dtype, flops, bandwidth)
        except Exception:  # noqa: BLE001 - rows of a foreign writer the model cannot draw (their own predictions
            continue  # were made elsewhere): their plots have no lines, the other cohorts' have theirs
    return pd.DataFrame(found, columns=[*LINE_KEYS, "series", "batch", "ctx", "predicted_step_s", "flops_per_step_model",
                                        "prefill_bytes_per_token", "decode_bytes_per_token", "kv_cache_bytes_at_ctx"])


def _lines_at_a_roof(mine: pd.DataFrame, model: str, dtype: str, flops: float, bandwidth: float) -> list[dict]:
    """The lines of the rows of one model and dtype predicted at one roof, one per series and batch."""
    found = []
    shape, roof = shape_of(mine.iloc[0]), analytic.Roof(float(flops), float(bandwidth))
    steps = int(mine["decode_tokens"].mode().iloc[0])
    grid = context_grid(mine["ctx"])
    layouts = {series: layout_of(theirs.iloc[0]) for series, theirs in mine.groupby("series")}
    for batch in sorted(int(b) for b in mine["batch"].unique()):
        for ctx in grid:
            ctx = int(ctx)
            per_batch = {"prefill_bytes_per_token": analytic.prefill_bytes_per_token(shape, dtype, batch, ctx),
                         "decode_bytes_per_token": analytic.decode_bytes_per_token(shape, dtype, batch, ctx),
                         "kv_cache_bytes_at_ctx": analytic.kv_cache_bytes(shape, dtype, batch, ctx)}
            for series, layout in layouts.items():
                step = predict(shape, dtype, batch, ctx, steps, layout, roof)
                found.append({"model": model, "dtype": dtype, "roof_flops_used": flops, "roof_bandwidth_used": bandwidth,
                              "series": series, "batch": batch, "ctx": ctx, "predicted_step_s": step["predicted_step_s"],
                              "flops_per_step_model": step["flops_per_step_model"], **per_batch})
    return found


def shape_figures(shape: ModelConfig, dtype: str) -> dict:
    return {"kv_bytes_per_token": analytic.kv_bytes_per_token(shape, dtype),
            "weight_bytes": analytic.weight_bytes(shape, dtype),
            "tokens_to_match_weights": analytic.tokens_to_match_weights(shape, dtype)}


def model_preset(name: str) -> ModelConfig:
    return model_config_from(yaml.safe_load((MODEL_DIR / f"{name}.yaml").read_text()))


def published() -> pd.DataFrame:
    return pd.DataFrame([{"model": name, "dtype": dtype, **shape_figures(model_preset(name), dtype)}
                         for name in sorted(p.stem for p in MODEL_DIR.glob("*.yaml"))
                         for dtype in ("float32", "bfloat16")])


def example_figures() -> dict:
    """The questions' example deployment and what the analytic model says of it: Llama 3 70B in bf16 on
    an H100 SXM's datasheet roof, batch 1, a 4,096-token prompt, 512 decode steps."""
    shape, dtype, hardware = model_preset("llama3_70b"), "bfloat16", "h100_sxm"
    roof, p, steps, long = load_hardware(hardware).roof(dtype), 4096, 512, 32768
    growth = [{"ctx": c, "flops_cached": analytic.decode_step_flops(shape, 1, c),
               "flops_full": analytic.decode_step_flops(shape, 1, c, layout=None),
               "total_cached": analytic.generate_flops(shape, 1, c, steps),
               "total_full": analytic.generate_flops(shape, 1, c, steps, layout=None)} for c in (512, 2048, 8192, 32768)]
    return {
        "shape": shape, "dtype": dtype, "hardware": hardware, "roof": roof, "batch": 1, "ctx": p, "steps": steps,
        **shape_figures(shape, dtype), "growth": growth,
        "cached_bytes": analytic.decode_step_bytes(shape, dtype, 1, p)["total"],
        "cached_flops": analytic.decode_step_flops(shape, 1, p),
        "full_flops": analytic.decode_step_flops(shape, 1, p, layout=None),
        "cached_step_s": analytic.decode_step_time(shape, dtype, 1, p, roof),
        "full_step_s": analytic.decode_step_time(shape, dtype, 1, p, roof, layout=None),
        "prefill_bytes_per_token": analytic.prefill_bytes_per_token(shape, dtype, 1, p),
        "decode_bytes_per_token": analytic.decode_bytes_per_token(shape, dtype, 1, p),
        "prefill_s": analytic.prefill_time(shape, dtype, 1, p, roof),
        "long_ctx": long,
        "few_bytes": analytic.decode_step_bytes(shape, dtype, 1, long)["total"],
        "many_bytes": analytic.decode_step_bytes(shape, dtype, 32, long // 32)["total"],
        "few_step_s": analytic.decode_step_time(shape, dtype, 1, long, roof),
        "many_step_s": analytic.decode_step_time(shape, dtype, 32, long // 32, roof),
        "long_cache_bytes": analytic.kv_cache_bytes(shape, dtype, 1, long),
    }


def analytic_tables(rows: pd.DataFrame) -> AnalyticTables:
    """The tables for a loaded table of rows (harness.analysis.results.load: series and roof_*_used set)."""
    if rows.empty or "roof_flops_used" not in rows:
        rows = pd.DataFrame(columns=[*LINE_KEYS, "series", "batch", "ctx", "decode_tokens", "caches_kv"])
    return AnalyticTables(lines=_lines(rows), published=published(), example=example_figures())

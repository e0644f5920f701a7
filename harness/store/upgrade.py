"""Rows of any earlier schema_version read as rows of today: the one place that knows how the column
set changed (harness.store.columns.SCHEMA_VERSION), used by every reader (harness.analysis.results.load).

A row without `schema_version` was written before the column existed: version 0. Each step below
brings rows of one version to the next; after the steps, every column of today's schema that a row
still lacks is added, null, with its schema type. What a step cannot know without the analytic model
(the prediction columns of version 1) it leaves null: the loader's re-prediction step fills those
(harness.analysis.results.add_predictions), since the store sits above the analysis in the layers.

So no reader checks whether a column exists, or what a null meant in an older row: here it is said
once, per version.
"""
from __future__ import annotations

import math
import numbers

import pandas as pd
import pyarrow as pa

from harness.store.columns import SCHEMA, SCHEMA_VERSION


def _to_version_1(rows: pd.DataFrame, old: pd.Series) -> None:
    """Version 0 (before 2026-12) to 1: the prediction columns were added (left null, for the loader's
    re-prediction), and columns added over version 0's life read as what they meant before they
    existed: default pages, eager (no compile), the variant's class is the strategy itself, seeded
    random weights, the accuracy scored after the point's own ctx, and a perplexity ratio (without an
    interval) from the two perplexities where only they were recorded."""
    for column, before in (("hugepages", False), ("compile", "none"), ("weights", "random")):
        if column in rows:
            rows.loc[old & rows[column].isna(), column] = before
    if "strategy_family" in rows and "strategy" in rows:
        rows.loc[old & rows["strategy_family"].isna(), "strategy_family"] = rows["strategy"]
    scored = old & rows["logit_kl_mean"].notna() & rows["accuracy_ctx"].isna()
    rows.loc[scored, "accuracy_ctx"] = rows.loc[scored, "ctx"]
    perplexities = pd.to_numeric(rows["perplexity"], errors="coerce") / pd.to_numeric(
        rows["perplexity_reference"], errors="coerce").where(lambda p: p != 0)
    alone = old & rows["perplexity_ratio"].isna() & perplexities.notna()
    for column in ("perplexity_ratio", "perplexity_ratio_ci_low", "perplexity_ratio_ci_high"):
        rows.loc[alone, column] = perplexities[alone]


def _to_version_2(rows: pd.DataFrame, old: pd.Series) -> None:
    """Version 1 to 2: the shape's own figures (kv_bytes_per_token, tokens_to_match_weights) and the bytes
    per token held at the accuracy pass's length (accuracy_kv_bytes_per_token_held) were added. Each is
    the analytic model's: left null here, filled by the loader's re-prediction step (harness.analysis.
    results.add_predictions), which fills every roof-free prediction a row lacks."""


def _to_version_3(rows: pd.DataFrame, old: pd.Series) -> None:
    """Version 2 to 3: the serving run's columns were added (workload_*, serving_*, the serving metrics,
    the simulation's simulated, simulates_point_key and step_fit_*); a row of version 2 or before is a step measurement, whose serving columns are null, as `complete`
    leaves them."""


def _to_version_4(rows: pd.DataFrame, old: pd.Series) -> None:
    """Version 3 to 4: timing.adapt_threads and decode_steps_fewer_threads were added. Before, every step
    ran at the point's `threads`: a measured row of a cache's steps ran none at fewer (an engine's row, on
    its own pool, stays null, as does a compiled step's: its kernels fix their count), and no thread
    count was adapted."""
    rows.loc[old & rows["timing_adapt_threads"].isna(), "timing_adapt_threads"] = False
    eager = rows["compile"].isna() | rows["compile"].eq("none")
    rows.loc[old & rows["decode_step_s"].notna() & rows["engine"].isna() & eager, "decode_steps_fewer_threads"] = 0


STEPS = {0: _to_version_1, 1: _to_version_2, 2: _to_version_3, 3: _to_version_4}  # version -> the function bringing its rows to the next version


def unreadable_versions(rows: pd.DataFrame) -> pd.Series:
    """Per row, why its schema_version names no column set this harness knows (null where it does): a
    version from the future (a newer harness wrote the row: read as today's, its columns would be
    misread), or one no harness writes (fractional, negative, not a number). Such a row is refused by
    the loader, named with its file, never relabelled. A row without the column, or null in it, was
    written before the column existed: version 0."""
    if "schema_version" not in rows:
        return pd.Series([None] * len(rows), index=rows.index, dtype=object)
    return rows["schema_version"].map(_unreadable_version).astype(object)


def _unreadable_version(value) -> str | None:
    if value is None or value is pd.NA or (isinstance(value, float) and math.isnan(value)):
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return f"schema_version {value!r} is not a version number (an integer from 0 to {SCHEMA_VERSION})"
    whole = math.isfinite(value) and value == int(value)
    shown = int(value) if whole and abs(value) < 2**63 else f"{value:g}"  # -1 beside null rows reads as -1.0
    if not whole or value < 0:
        return f"schema_version {shown} is no version a harness writes (an integer from 0 to {SCHEMA_VERSION})"
    if value > SCHEMA_VERSION:
        return (f"schema_version {shown} is newer than this harness reads ({SCHEMA_VERSION}): a newer "
                "kv-decode-harness wrote it; read it with that version")
    return None


def upgrade(rows: pd.DataFrame) -> pd.DataFrame:
    """rows, of any versions at once, brought to SCHEMA_VERSION; every schema column present (a copy).
    Every row's version must be readable (unreadable_versions: the loader leaves the others out)."""
    unreadable = unreadable_versions(rows).dropna()
    if len(unreadable):
        raise ValueError(unreadable.iloc[0])
    rows = complete(rows)
    version = pd.to_numeric(rows["schema_version"], errors="coerce").fillna(0).astype(int)
    for step_from in sorted(STEPS):
        old = version <= step_from
        if old.any():
            STEPS[step_from](rows, old)
    rows["schema_version"] = pd.array([SCHEMA_VERSION] * len(rows), dtype="Int64")
    return rows


def complete(rows: pd.DataFrame) -> pd.DataFrame:
    """rows (a copy) with every column of today's schema, those it lacks null with their schema type."""
    missing = {field.name: pd.Series([None] * len(rows), index=rows.index, dtype=_pandas_dtype(field.type))
               for field in SCHEMA if field.name not in rows}
    return pd.concat([rows, pd.DataFrame(missing, index=rows.index)], axis=1) if missing else rows.copy()


def _pandas_dtype(arrow_type: pa.DataType):
    """The pandas dtype a column of this Arrow type reads as (nullable integers and booleans)."""
    if pa.types.is_integer(arrow_type):
        return "Int64"
    if pa.types.is_floating(arrow_type):
        return "float64"
    if pa.types.is_boolean(arrow_type):
        return "boolean"
    if pa.types.is_timestamp(arrow_type):
        return "datetime64[us, UTC]"
    return "object"

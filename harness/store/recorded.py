"""What a row records of its point, read back: its decoder shape, its cache layout, and whether the two
describe a point the harness could have measured at all.

A row is flattened from its resolved point (harness.run.row.flatten); its prediction can be rebuilt from
these columns alone (harness.analysis.results.add_predictions), and its layout decides whether it could
be a group's reference (harness.config.layout.could_be_reference). A folder may hold rows no runner
wrote (copied, edited, another program's): `odd_points` names the rows whose point no run accepts (a
ctx of 0, a negative batch, a shape that cannot exist), so such a row costs its own line in a report,
not the report.
"""
from __future__ import annotations

import dataclasses
import json

import pandas as pd

from harness.config import CacheLayout, ModelConfig
from harness.config.validate import INT64_MAX, POSITIVE_MODEL_KEYS, POSITIVE_RUN_KEYS, ConfigError, positive_int

# The point columns a prediction is made from, each a whole number from 1 (harness.config.validate's
# rules for the keys they come from).
POSITIVE_COLUMNS = (*POSITIVE_RUN_KEYS, *POSITIVE_MODEL_KEYS, "head_dim")


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


def _present(value) -> bool:
    return value is not None and not pd.isna(value)


def layout_of(row) -> CacheLayout | None:
    """The cache layout recorded in a row's cache_* columns (None: the strategy keeps no cache)."""
    if not _present(row["caches_kv"]) or not bool(row["caches_kv"]):
        return None
    values = {}
    for field in dataclasses.fields(CacheLayout):
        column = f"{CacheLayout.ROW_PREFIX}{field.name}"
        if _present(row[column]):
            values[field.name] = type(field.default)(row[column])
    return CacheLayout(**values)


def odd_points(rows: pd.DataFrame) -> pd.Series:
    """Per row, why its recorded point is none the harness measures ("" where it is one): a strategy or
    model with no name, strategy options that are not a JSON object, or the first of POSITIVE_COLUMNS that
    is missing or not a whole number from 1, in the words the runner refuses it with."""
    why = pd.Series("", index=rows.index, dtype=object)
    for column in ("strategy", "model"):
        named = rows[column].map(lambda name: isinstance(name, str) and name != "") if column in rows else False
        why[~named & (why == "")] = f"{column}: names nothing"
    if "strategy_options" in rows:
        options = rows["strategy_options"].map(_an_object_or_null)
        why[~options & (why == "")] = "strategy_options: not a JSON object"
    for column in POSITIVE_COLUMNS:
        values = pd.to_numeric(rows[column], errors="coerce") if column in rows else pd.Series(float("nan"), index=rows.index)
        bad = ~(values.notna() & (values >= 1) & (values <= INT64_MAX) & (values % 1 == 0)) & (why == "")
        for index in rows.index[bad]:
            why[index] = _refusal(column, rows.at[index, column] if column in rows else None)
    return why


def _an_object_or_null(text) -> bool:
    if not _present(text):
        return True
    try:
        return isinstance(json.loads(text), dict)
    except (TypeError, ValueError, RecursionError):
        return False


def _refusal(column: str, value) -> str:
    """The runner's one line for `column` = value."""
    if not _present(value):
        value = None
    elif isinstance(value, (int, float)) or hasattr(value, "item"):  # numpy's scalars: said as plain numbers
        value = value.item() if hasattr(value, "item") else value
        value = int(value) if isinstance(value, float) and value.is_integer() else value
    try:
        positive_int(column, value)
    except ConfigError as error:
        return str(error)
    return ""

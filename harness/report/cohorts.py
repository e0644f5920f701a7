"""Rows of one model on one machine's device in one dtype: what every plot and comparison is drawn from.

Rows of different shapes, devices (two GPU types are two devices) or dtypes are never drawn on the same axes; a folder holding several
such cohorts gets one set of plots per cohort. (A cohort holds many groups: the points timed together.)
"""
from __future__ import annotations

import dataclasses
import hashlib
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
from omegaconf import OmegaConf

from harness.analysis.curves import LINE_KEYS
from harness.analysis.results import SERIES, Results
from harness.config import CacheLayout, could_be_reference
from harness.config.paths import LocationError, checkpoint_location, config_dir
from harness.store.recorded import layout_of

# The linear-layer kernel is a measurement condition like the dtype: aten, oneDNN and C rows of the same
# point can differ several-fold on a CPU, so they are never drawn as one strategy's points.
# A cohort is one machine's view of one model: rows of two GPU types (both `cuda`) or two CPUs are never
# drawn on one axis, each cohort has its own roofs.
COHORT_KEYS = ["model", "device", "device_name", "dtype", "matmul_kernel"]
SLUG_MAX = 150  # characters of a cohort's slug: with a plot's prefix and suffix, well within a file name's 255 bytes
LAYOUT_COLUMNS = [f"{CacheLayout.ROW_PREFIX}{field.name}" for field in dataclasses.fields(CacheLayout)]  # a row's layout


@dataclass
class Cohort:
    """One model x device x dtype slice of the results, with the roof its predictions use."""

    model: str  # preset name
    device: str  # cpu | cuda
    dtype: str  # float32 | bfloat16 | float16
    matmul_kernel: str  # linear-layer kernel of the rows ("" where none of them recorded one)
    device_name: str  # processor or GPU model of the rows
    roof_flops: float  # the FLOP roof the predictions of these rows use, FLOP/s
    roof_bandwidth: float  # the read roof the predictions of these rows use, B/s
    roof_source: str  # measured | datasheet
    roof_description: str  # which calibration or datasheet, and why
    decode_tokens: int  # decode steps per point (the most common value)
    rows: pd.DataFrame  # every row of the cohort, whatever its status
    ok: pd.DataFrame  # rows with status ok, a prediction, a usable step time, not noisy: what absolute times and fits use
    unusable: pd.DataFrame = field(default_factory=pd.DataFrame)  # status ok, but no finite step time above 0
    lines: pd.DataFrame = field(default_factory=pd.DataFrame)  # the analytic lines at this roof (curves.AnalyticTables.lines)
    figures: dict = field(default_factory=dict)  # the shape's kv_bytes_per_token, weight_bytes, tokens_to_match_weights (its rows' columns)
    timed: pd.DataFrame = field(default_factory=pd.DataFrame)  # `ok` and the noisy rows beside it (`noisy` a bool):
    # what ratios between members timed together and memory use, which a busy machine does not break

    def line(self, series: str | None, batch: int, column: str) -> tuple[np.ndarray, np.ndarray]:
        """(contexts, the analytic `column` at each) of a series at a batch, along the context grid, which
        spans the cohort's contexts and holds each of them; series None: any (a figure of no layout)."""
        lines = self.lines if series is None else self.lines[self.lines[SERIES] == series]
        if series is None and len(lines):
            lines = lines[lines[SERIES] == lines[SERIES].iloc[0]]
        mine = lines[lines["batch"] == int(batch)].sort_values("ctx")
        return mine["ctx"].to_numpy(int), mine[column].to_numpy(float)

    def at(self, series: str, batch: int, ctx: int, column: str) -> float:
        """The analytic `column` of a series at one batch and context (a context of the rows)."""
        contexts, values = self.line(series, batch, column)
        found = values[contexts == int(ctx)]
        return float(found[0]) if len(found) else float("nan")

    @property
    def title(self) -> str:
        matmul = f" · {self.matmul_kernel}" if self.matmul_kernel else ""
        return f"{self.model} · {self.device} ({self.device_name}) · {self.dtype}{matmul}"

    @property
    def slug(self) -> str:
        """The cohort in its plots' file names: one name (a row's names are a foreign writer's too, so no
        separator or control character), at most SLUG_MAX characters (a long one ends in its hash)."""
        matmul = f"_{self.matmul_kernel.split('.')[0]}" if self.matmul_kernel else ""
        machine = re.sub(r"[^A-Za-z0-9]+", "-", self.device_name).strip("-").lower()[:40]
        named = f"{self.model}_{self.device}_{machine}_{self.dtype}{matmul}"
        slug = re.sub(r"[^A-Za-z0-9._-]+", "-", named)
        if len(slug) > SLUG_MAX:
            slug = f"{slug[:SLUG_MAX - 13]}-{hashlib.sha256(named.encode()).hexdigest()[:12]}"
        return slug

    @property
    def model_key(self) -> str:
        """The model as a command line names it: `model=<preset>` where the rows' model is a preset of
        conf/model/ or their checkpoint is a preset's (a checkpoint's rows are named after its file,
        which is no preset), else `model.checkpoint=<the file or folder the rows read>`."""
        if is_preset(self.model):
            return f"model={self.model}"
        checkpoints = self.rows["checkpoint"].dropna() if "checkpoint" in self.rows else pd.Series(dtype=object)
        if not len(checkpoints):
            return f"model={self.model}"
        preset = preset_of_checkpoint(str(checkpoints.iloc[0]))
        return f"model={preset}" if preset else f"model.checkpoint={checkpoints.iloc[0]}"

    def strategies(self) -> list[str]:
        """The strategies of the cohort's ok rows: the recompute reference first, then by name."""
        return ordered_strategies(self.ok)

    def plain_cache(self) -> str | None:
        """The series the cache-against-no-cache figures use (see plain_cache_strategy)."""
        return plain_cache_strategy(self.timed)

    def plain_cache_strategy_name(self) -> str | None:
        """The `strategy=` value of plain_cache's rows, for a command line (a series may carry options)."""
        series = self.plain_cache()
        return None if series is None else str(self.timed.loc[self.timed[SERIES] == series, "strategy"].iloc[0])


# What the report needs to know of a strategy, it reads from the row's capability columns (caches_kv,
# exact, cache_*), never from its name: a strategy added later appears in every table and plot.


def is_preset(name: str) -> bool:
    """Whether `name` is a preset of conf/model/ (a foreign row's model may be any text: no file, or none a
    file can have)."""
    if Path(name).name != name:
        return False
    try:
        return (config_dir() / "model" / f"{name}.yaml").is_file()
    except OSError:  # a name longer than a file's
        return False


def preset_of_checkpoint(path: str) -> str | None:
    """The preset of conf/model/ whose checkpoint is the file or folder `path` (absolute, as rows record
    it), or None."""
    for preset in sorted((config_dir() / "model").glob("*.yaml")):
        named = OmegaConf.load(preset).get("checkpoint")
        try:
            if named and checkpoint_location(str(named)) == Path(path):
                return preset.stem
        except LocationError:  # a preset's package not installed here: not the rows' checkpoint
            continue
    return None


def newest_per_point(rows: pd.DataFrame, point_columns) -> pd.DataFrame:
    """One row per point (rows equal on `point_columns`): the newest where a folder holds re-runs."""
    if "timestamp" in rows:
        rows = rows.sort_values("timestamp", kind="stable", na_position="first")
    return rows.drop_duplicates(subset=point_columns, keep="last")


def recompute_rows(rows: pd.DataFrame) -> pd.DataFrame:
    """Rows of the recompute reference: strategies that keep no cache."""
    return rows[~rows["caches_kv"].fillna(False).astype(bool)]


def cached_rows(rows: pd.DataFrame) -> pd.DataFrame:
    """Rows of strategies that keep a K/V cache."""
    return rows[rows["caches_kv"].fillna(False).astype(bool)]


def could_be_references(rows: pd.DataFrame) -> pd.Series:
    """Each row's answer to the one reference rule (harness.config.layout.could_be_reference), read from its
    `exact` flag and its cache_* columns (harness.store.recorded.layout_of); answered once per kind of row."""
    columns = ["exact", "caches_kv", *LAYOUT_COLUMNS]
    answers: dict[tuple, bool] = {}
    found = []
    for values in rows[columns].astype(object).itertuples(index=False, name=None):
        kind = tuple(None if pd.isna(value) else value for value in values)
        if kind not in answers:
            recorded = dict(zip(columns, kind))
            answers[kind] = could_be_reference(bool(recorded["exact"]), layout_of(recorded))
        found.append(answers[kind])
    return pd.Series(found, index=rows.index, dtype=bool)


def plain_cache_strategy(rows: pd.DataFrame) -> str | None:
    """The series the others are set against where the rows name none (older rows; the no-cache figures): a
    cache that could be a reference by the one rule (could_be_references), else any exact cache, else any
    cache; the lexically first where several qualify."""
    cached = cached_rows(rows)
    if cached.empty:
        return None
    exact = cached[cached["exact"].fillna(False).astype(bool)]
    plain = cached[could_be_references(cached)]
    pool = plain if not plain.empty else (exact if not exact.empty else cached)
    return sorted(pool[SERIES].unique())[0]


def ordered_strategies(rows: pd.DataFrame) -> list[str]:
    """Strategy names of the rows: the recompute references first, then the caches, each by name."""
    recomputes = set(recompute_rows(rows)[SERIES])
    return sorted(rows[SERIES].unique(), key=lambda s: (s not in recomputes, s))


def cohorts_of(results: Results) -> list[Cohort]:
    """One Cohort per model/device/dtype with at least one predicted row, largest first, from the loader's
    rows and tables (harness.analysis.results.read_results)."""
    table, analytic = results.rows, results.tables
    if table.empty or "roof_flops_used" not in table:
        return []
    found = []
    # A row the loader could not predict (an odd point, a dtype the model does not know) is in no cohort,
    # plot or ratio: the report lists it, with why, among the rows not measured.
    table = _with_usual_conditions(table[table["roof_source"] != "none"])
    for (model, device, device_name, dtype, matmul_kernel), rows in table.groupby(COHORT_KEYS, sort=True):
        predicted = rows[rows["roof_flops_used"].notna()]
        if predicted.empty:
            continue
        first = predicted.iloc[0]
        roof = first[LINE_KEYS].tolist()
        lines = analytic.lines[(analytic.lines[LINE_KEYS] == roof).all(axis=1)]
        ran = predicted[predicted["status"] == "ok"]
        usable = usable_step(ran)
        ran = ran.assign(noisy=noisy_flags(ran))
        timed = ran[usable].copy()  # noisy rows too: their ratios to members timed in the same rounds hold
        ok = timed[~timed["noisy"]].copy()  # noisy rows stay out of what compares a time with a roof, and of fits
        found.append(Cohort(
            model=str(model), device=str(device), dtype=str(dtype), matmul_kernel=str(matmul_kernel),
            device_name=str(device_name),
            roof_flops=float(first["roof_flops_used"]), roof_bandwidth=float(first["roof_bandwidth_used"]),
            roof_source=str(first["roof_source"]), roof_description=str(first["roof_description"]),
            decode_tokens=int(rows["decode_tokens"].mode().iloc[0]),
            rows=rows, ok=ok, timed=timed, unusable=ran[~usable],
            lines=lines, figures=shape_figures(predicted),
        ))
    return sorted(found, key=lambda g: -len(g.timed))


def shape_figures(rows: pd.DataFrame) -> dict:
    """The shape's figures its rows carry (kv_bytes_per_token, weight_bytes, tokens_to_match_weights: one
    model and dtype, so one value each), {} where no row carries all three."""
    columns = ["kv_bytes_per_token", "weight_bytes", "tokens_to_match_weights"]
    carried = rows[columns].dropna()
    if carried.empty:
        return {}
    first = carried.iloc[0]
    return {"kv_bytes_per_token": int(first["kv_bytes_per_token"]), "weight_bytes": int(first["weight_bytes"]),
            "tokens_to_match_weights": float(first["tokens_to_match_weights"])}


def noisy_flags(rows: pd.DataFrame) -> pd.Series:
    """Each row's `noisy` flag as a plain bool (False where the column is absent or null)."""
    if "noisy" not in rows:
        return pd.Series(False, index=rows.index)
    return rows["noisy"].astype(object).where(rows["noisy"].notna(), False).astype(bool)


def usable_step(rows: pd.DataFrame) -> pd.Series:
    """Whether each row's decode step time is a time: finite and above 0. A row can record none (a
    column null in every row of an odd folder) or a 0, a negative or an infinity (a clock that did not
    move, a foreign writer): nothing such can be drawn on a log axis or divided by."""
    if "decode_step_s" not in rows:
        return pd.Series(False, index=rows.index)
    step = pd.to_numeric(rows["decode_step_s"], errors="coerce").astype(float)
    return step.notna() & np.isfinite(step) & (step > 0)


def _with_usual_conditions(table: pd.DataFrame) -> pd.DataFrame:
    """Rows that did not run (skipped, failed) record no linear kernel and may record no device name:
    they join the kernel and the device most rows of their model/device/dtype used, so they are listed
    with those rows."""
    for column, fallback in (("matmul_kernel", ""), ("device_name", table["device"])):
        if column not in table:
            table = table.assign(**{column: fallback})
            continue
        usual = table.groupby(["model", "device", "dtype"])[column].transform(
            lambda values: values.mode().iloc[0] if values.notna().any() else None)
        values = table[column].astype(object)  # object: filled from a Series of another dtype without a cast
        known = values.where(values.notna(), usual.astype(object))
        table = table.assign(**{column: known.where(known.notna(), fallback)})
    return table

"""The figures behind "what fewer bytes buy": per cache variant and point, the bytes it holds per token,
its step time against the exact cache's (paired, measured in the same group), how far its outputs
moved (KL divergence, same top-1, perplexity), and whether it sits on the Pareto front of bytes
against accuracy.

Columns read (docs/columns.md): the variant is the row's `series` (its `strategy` name, with the
options that tell its rows apart), its class `strategy_family`; the speed `ratio_to_reference`
[`ratio_ci_low`, `ratio_ci_high`] against `group_reference`; the accuracy `logit_kl_mean`
[`logit_kl_mean_ci_low`, `_high`], `logit_kl_p99`, `logit_kl_max`, `top1_agreement`,
`perplexity_ratio` [`perplexity_ratio_ci_low`, `_high`] over `accuracy_tokens` scored tokens that follow
`accuracy_ctx` tokens. Rows written before some of these existed still give what they have: a step
ratio from their timed steps (harness.report.verdicts.compare), a perplexity ratio without interval,
and `missing_columns` names the rest.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import pandas as pd

from harness.analysis.results import SERIES
from harness.measure.intervals import Interval
from harness.report import units as fmt
from harness.report.cohorts import Cohort, cached_rows, newest_per_point, plain_cache_strategy, usable_step
from harness.report.verdicts import Comparison, any_noisy, compare

SPEED_COLUMNS = ("ratio_to_reference", "ratio_ci_low", "ratio_ci_high")
ACCURACY_COLUMNS = ("strategy_family", "accuracy_tokens", "accuracy_ctx", "top1_agreement", "logit_kl_mean",
                    "logit_kl_mean_ci_low", "logit_kl_mean_ci_high", "logit_kl_p99", "logit_kl_max",
                    "perplexity_ratio", "perplexity_ratio_ci_low", "perplexity_ratio_ci_high")


def value(row, column: str) -> Optional[float]:
    """A row's number, None where the column is absent, null or not finite."""
    found = row.get(column) if hasattr(row, "get") else None
    if fmt.missing(found) or not math.isfinite(float(found)):
        return None
    return float(found)


def flag(row, column: str) -> bool:
    """A row's boolean, False where the column is absent or null (pandas' NA has no truth value)."""
    found = row.get(column) if hasattr(row, "get") else None
    return not fmt.missing(found) and bool(found)


def interval(row, column: str, low: str, high: str) -> Optional[Interval]:
    """A row's figure with its interval (of zero width where the row recorded none), or None."""
    middle = value(row, column)
    if middle is None:
        return None
    lower, upper = value(row, low), value(row, high)
    return Interval(middle, middle if lower is None else lower, middle if upper is None else upper)


@dataclass(frozen=True)
class Accuracy:
    """How far one variant's outputs moved from the exact reference's at one point; exact: not at all."""

    exact: bool  # the class is proven to reproduce the reference: the figures below are not measured
    kl: Optional[Interval] = None  # mean KL(reference || variant) per scored token, nats, with its 95% interval
    kl_p99: Optional[float] = None  # 99th percentile of the per-token KL
    kl_max: Optional[float] = None  # the largest per-token KL
    top1: Optional[float] = None  # share of scored tokens whose argmax is the reference's
    perplexity: Optional[Interval] = None  # perplexity ÷ the reference's on the same text, with its interval
    tokens: Optional[int] = None  # tokens scored

    @property
    def kl_or_zero(self) -> Optional[float]:
        """The KL the Pareto front compares: 0 for an exact variant, None where none was measured."""
        return 0.0 if self.exact else (self.kl.median if self.kl is not None else None)


def accuracy_of(row) -> Accuracy:
    if flag(row, "exact"):
        return Accuracy(exact=True)
    perplexity = interval(row, "perplexity_ratio", "perplexity_ratio_ci_low", "perplexity_ratio_ci_high")
    tokens = value(row, "accuracy_tokens")
    return Accuracy(exact=False, kl=interval(row, "logit_kl_mean", "logit_kl_mean_ci_low", "logit_kl_mean_ci_high"),
                    kl_p99=value(row, "logit_kl_p99"), kl_max=value(row, "logit_kl_max"),
                    top1=value(row, "top1_agreement"), perplexity=perplexity,
                    tokens=None if tokens is None else int(tokens))


@dataclass(frozen=True)
class VariantPoint:
    """One cache variant at one point of a cohort, beside the exact reference cache of its group."""

    series: str  # the variant as every table and plot names it
    family: str  # its strategy class (strategy_family; the strategy name in older rows)
    batch: int
    ctx: int
    accuracy_ctx: int  # the context its scored tokens follow (the point's ctx where not recorded)
    accuracy_steps: int  # decode steps the scored tokens span (the point's decode_tokens where not recorded)
    bytes_per_token: float  # cache bytes per token held at ctx + decode_tokens (the row's kv_bytes_per_token_held)
    bytes_ratio: float  # ÷ the reference's bytes per token
    scored_bytes_per_token: float  # held at the end of its accuracy windows (accuracy_kv_bytes_per_token_held);
    # an exact variant's bytes per token, which no length changes: it stores every token at full width
    step: Optional[Comparison]  # this step ÷ the reference's (marked noisy where it draws on a noisy row); None for the reference
    noisy: bool  # the row's absolute times are not to be trusted (its paired ratio and its accuracy still are)
    predicted: float  # the roofline's step ratio, this layout ÷ the reference's
    accuracy: Accuracy
    is_reference: bool  # the exact cache the ratios are taken against


def ran_rows(cohort: Cohort) -> pd.DataFrame:
    """Rows that ran with a usable step time, noisy ones included: a noisy row's accuracy does not depend
    on the machine's load."""
    rows = cohort.rows[cohort.rows["status"] == "ok"]
    return rows[usable_step(rows)]


def narrow_or_approximate(rows: pd.DataFrame) -> pd.DataFrame:
    """Cached rows stored below the compute dtype's width or not exact: the variants that trade accuracy."""
    cached = cached_rows(rows)
    bits = cached["cache_value_bits"].fillna(0) > 0
    approximate = ~cached["exact"].fillna(True).astype(bool)
    return cached[bits | approximate]


def reference_series(ran: pd.DataFrame) -> Optional[str]:
    """The exact cache the ratios are against: the group's recorded reference where the rows name one
    (its point key, group_reference_key; else its name, group_reference), else the plainest exact cache
    among them (cohorts.plain_cache_strategy)."""
    if "group_reference_key" in ran and "point_key" in ran and ran["group_reference_key"].notna().any():
        named = ran[ran["point_key"].isin(ran["group_reference_key"].dropna().unique())]
    elif "group_reference" in ran:
        named = ran[ran["strategy"].isin(ran["group_reference"].dropna().unique())]
    else:
        named = ran.iloc[:0]
    if len(named):
        named = named[named["exact"].fillna(False).astype(bool)] if "exact" in named else named
        if named[SERIES].nunique() == 1:
            return str(named[SERIES].iloc[0])
    return plain_cache_strategy(ran)


def step_ratio(ran: pd.DataFrame, row, reference: str) -> Optional[Comparison]:
    """The row's step ÷ the reference's: its recorded paired ratio where it has one, else compared from
    the two series' rows at the point (paired where timed in one group, else apart); `noisy` where the
    row or the reference's at the point is flagged so."""
    at_point = ran[(ran["batch"] == row["batch"]) & (ran["ctx"] == row["ctx"])]
    theirs = at_point[at_point[SERIES] == reference]
    recorded = interval(row, "ratio_to_reference", "ratio_ci_low", "ratio_ci_high")
    if recorded is not None:
        return Comparison(recorded, paired=True, noisy=flag(row, "noisy") or any_noisy(theirs))
    return compare(at_point[at_point[SERIES] == row[SERIES]], theirs) if not theirs.empty else None


def point_ratio(at_point: pd.DataFrame, series: str, reference: str) -> Optional[Comparison]:
    """`series`' step ÷ the reference's at one point (rows of one batch and ctx): the row's own ratio
    where the series has one row there, else every repeat's rounds pooled (verdicts.compare)."""
    mine, theirs = at_point[at_point[SERIES] == series], at_point[at_point[SERIES] == reference]
    if mine.empty or theirs.empty:
        return None
    return step_ratio(at_point, mine.iloc[0], reference) if len(mine) == 1 else compare(mine, theirs)


def variant_points(cohort: Cohort) -> list[VariantPoint]:
    """Every cached variant at every point of the cohort where a narrow or approximate cache ran (its
    newest row, the step ratio pooled over its repeats); none where no such cache ran or no exact cache
    stands as the reference."""
    ran = ran_rows(cohort)
    reference = reference_series(ran)
    narrow = narrow_or_approximate(ran)
    if reference is None or narrow.empty:
        return []
    cached = cached_rows(ran)
    points = set(zip(narrow["batch"], narrow["ctx"]))
    at_points = {point: rows for point, rows in cached.groupby(["batch", "ctx"])}
    found = []
    for _, row in newest_per_point(cached, [SERIES, "batch", "ctx"]).iterrows():  # repeats: one line, pooled
        if (row["batch"], row["ctx"]) not in points:
            continue
        per_token = _or_nan(value(row, "kv_bytes_per_token_held"))
        reference_per_token = held_beside(cached, row, reference)
        steps = max(int(row["decode_tokens"]), 1)
        seconds = [cohort.at(one, row["batch"], row["ctx"], "predicted_step_s") for one in (row[SERIES], reference)]
        mine_is_reference = row[SERIES] == reference
        accuracy_ctx, accuracy_steps = value(row, "accuracy_ctx"), value(row, "accuracy_steps")
        found.append(VariantPoint(
            series=str(row[SERIES]), family=str(row.get("strategy_family") or row["strategy"]),
            batch=int(row["batch"]), ctx=int(row["ctx"]),
            accuracy_ctx=int(row["ctx"]) if accuracy_ctx is None else int(accuracy_ctx),
            accuracy_steps=steps if accuracy_steps is None else int(accuracy_steps),
            bytes_per_token=per_token, bytes_ratio=per_token / reference_per_token,
            scored_bytes_per_token=per_token if flag(row, "exact") else _or_nan(value(row, "accuracy_kv_bytes_per_token_held")),
            step=None if mine_is_reference else point_ratio(at_points[row["batch"], row["ctx"]], row[SERIES], reference),
            noisy=flag(row, "noisy"), predicted=seconds[0] / seconds[1],
            accuracy=accuracy_of(row), is_reference=mine_is_reference))
    # point by point, the reference first, then from the fewest bytes: each point's trade-off reads down
    return sorted(found, key=lambda p: (p.batch, p.ctx, not p.is_reference, p.bytes_per_token, p.series))


def _or_nan(found: Optional[float]) -> float:
    return float("nan") if found is None else found


def held_beside(cached: pd.DataFrame, row, series: str) -> float:
    """Bytes per token `series` holds at `row`'s length (ctx + decode_tokens): its row at the same point, or
    else at the same length (what a sequence holds does not depend on the batch); NaN where it has neither."""
    mine = cached[cached[SERIES] == series]
    same = mine[(mine["ctx"] + mine["decode_tokens"]) == row["ctx"] + row["decode_tokens"]]
    at_point = same[same["batch"] == row["batch"]]
    for found in (at_point, same):
        held = found["kv_bytes_per_token_held"].dropna()
        if len(held):
            return float(held.iloc[0])
    return float("nan")


@dataclass(frozen=True)
class FrontPoint:
    """One variant on the bytes-against-KL plane at one context its accuracy was measured after."""

    series: str
    accuracy_ctx: int  # the context the scored tokens follow
    bytes_per_token: float  # held by a sequence at that context and the scored steps after it
    accuracy: Accuracy  # the measurement that scored the most tokens there (exact: none needed)


def front_points(points: list[VariantPoint]) -> list[FrontPoint]:
    """Per context an accuracy was measured after, each approximate variant's measurement that scored
    the most tokens (the largest batch on a tie: batches differ only in which sequences were scored), and
    every exact variant, which is exact after any context. A point without a figure of bytes held (a
    foreign row's infinity or negative, left null by the loader) has no place on the plane: its table line
    says so, and the variant's other points stand for it."""
    points = [p for p in points if math.isfinite(p.scored_bytes_per_token) and p.scored_bytes_per_token > 0]
    best: dict[tuple[int, str], VariantPoint] = {}
    for point in points:
        if point.accuracy.exact or point.accuracy.kl is None:
            continue
        key, rank = (point.accuracy_ctx, point.series), (point.accuracy.tokens or 0, point.batch)
        if key not in best or rank > (best[key].accuracy.tokens or 0, best[key].batch):
            best[key] = point
    exact = {p.series: p for p in points if p.accuracy.exact}
    found = []
    for ctx in sorted({c for c, _ in best}):
        measured = [p for (c, _), p in sorted(best.items()) if c == ctx]
        for p in measured + list(exact.values()):  # each at the length its accuracy was scored at
            found.append(FrontPoint(p.series, ctx, p.scored_bytes_per_token, p.accuracy))
    return found


def pareto_front(points: list[FrontPoint]) -> set[tuple[int, str]]:
    """(accuracy ctx, variant) pairs on the front of bytes per token against mean KL at their context:
    no other variant there holds fewer or as many bytes with as little or less KL, one of them strictly.
    Two variants equal on both (an exact paged cache beside the contiguous one) are both on it."""
    front = set()
    for mine in points:
        rivals = [other for other in points if other.accuracy_ctx == mine.accuracy_ctx and other.series != mine.series]
        dominated = any(
            other.bytes_per_token <= mine.bytes_per_token and other.accuracy.kl_or_zero <= mine.accuracy.kl_or_zero
            and (other.bytes_per_token < mine.bytes_per_token or other.accuracy.kl_or_zero < mine.accuracy.kl_or_zero)
            for other in rivals)
        if not dominated:
            front.add((mine.accuracy_ctx, mine.series))
    return front


def missing_columns(cohort: Cohort, reference: str) -> list[str]:
    """The trade-off's columns that no row of the cohort records where it should (rows written before
    they existed, or without an accuracy pass): their cells read – and the section says so. Perplexity
    is left out where no row scored text (no prompt file: a condition of the run, said elsewhere)."""
    cached = cached_rows(ran_rows(cohort))
    others = cached[cached[SERIES] != reference]
    approximate = others[~others["exact"].fillna(True).astype(bool)] if "exact" in others else others

    def absent(rows: pd.DataFrame, columns) -> list[str]:
        return [c for c in columns if c not in rows or rows[c].isna().all()] if not rows.empty else []

    found = absent(cached, ["strategy_family"]) + absent(others, SPEED_COLUMNS)
    found += absent(approximate, [c for c in ACCURACY_COLUMNS if c != "strategy_family"])
    if "perplexity" not in approximate or approximate["perplexity"].isna().all():
        found = [c for c in found if not c.startswith("perplexity_ratio")]
    return found

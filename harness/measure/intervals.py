"""Confidence intervals of step times and of paired ratios, by bootstrap over a group's rounds.

A group's members take one timed step each per round (harness.measure.group), so round i of two
members saw the same machine within milliseconds: their ratio in round i is free of the drift that
moves a shared machine's bandwidth between rounds. The interval of a ratio therefore resamples whole
rounds (the pairs stay together), and the statistic is the median, which one descheduled step cannot
move. The percentile bootstrap: RESAMPLES draws of the rounds with replacement from a seeded
generator (the same rows give the same interval), the 2.5th and 97.5th percentiles of the medians.
With few rounds the interval is coarse (its ends are order statistics of the rounds), never narrower
than the data allow.
"""
from __future__ import annotations

import functools
import statistics
from dataclasses import dataclass
from typing import Sequence

import numpy as np

RESAMPLES = 2000  # bootstrap draws; the interval's ends move by well under 1% of its width beyond this
CONFIDENCE = 0.95  # two-sided
SEED = 0  # the bootstrap's generator: an interval is a function of its data alone
INTERVALS_REMEMBERED = 4096  # median intervals kept by their data: a report judges each point in several sections
DRAW_COUNTS_REMEMBERED = 8  # sample sizes whose draw counts are kept: a sweep's points mostly share a few
METHOD = (f"percentile bootstrap of the median over rounds ({RESAMPLES} resamples, {CONFIDENCE:.0%}); ratios "
          "resample paired rounds, so both members of a round stay together")


@dataclass(frozen=True)
class Interval:
    """A median and its confidence interval."""

    median: float
    low: float
    high: float

    @property
    def half_width(self) -> float:
        """Half the interval's width relative to its median: the resolution it gives."""
        return (self.high - self.low) / 2 / self.median if self.median else float("inf")

    def excludes(self, value: float) -> bool:
        return value < self.low or value > self.high


def median_interval(values: Sequence[float]) -> Interval:
    """The median of `values` and its bootstrap interval (one value: an interval of zero width)."""
    data = np.asarray(values, dtype=np.float64)
    median = float(statistics.median(values))
    if len(data) < 2:
        return Interval(median, median, median)
    low, high = _bootstrap_median_bounds(data.tobytes())
    return Interval(median, low, high)


@functools.lru_cache(maxsize=INTERVALS_REMEMBERED)
def _bootstrap_median_bounds(data_bytes: bytes) -> tuple[float, float]:
    """The percentile-bootstrap interval of the median of the float64 values in `data_bytes`: the data's
    own bytes are the key, so the report's sections, which judge the same points again, draw each once.

    Bit for bit the interval np.median over the resampled values gives, at a fraction of its cost. The draws
    depend on the count alone (the generator is seeded), so how often each position is drawn in each resample
    is counted once per count (_drawn). Reordered by the values' ranks and summed along, those counts say
    which rank sits at each place of a sorted resample: the middle one(s) are found by comparisons instead
    of a partition of every resample."""
    data = np.frombuffer(data_bytes, dtype=np.float64)
    count = len(data)
    if np.isnan(data).any():  # a resample holding a NaN has a NaN median, which ranks cannot say
        draws = np.random.default_rng(SEED).integers(0, count, size=(RESAMPLES, count))
        return _percentile_bounds(np.median(data[draws], axis=1))
    order = np.argsort(data, kind="stable")  # order[r]: the position of the value of rank r
    below = _drawn(count)[order].astype(np.int32)  # [r, i]: draws of rank r in resample i ...
    np.cumsum(below, axis=0, out=below)  # ... now of rank <= r: summed down the rows, each a contiguous run
    places = [(count - 1) // 2, count // 2]  # the one middle place twice, or the two an even count averages
    rank_at = {place: np.count_nonzero(below <= place, axis=0) for place in set(places)}  # the rank there, per resample
    picked = np.stack([rank_at[place] for place in places], axis=1)
    return _percentile_bounds(np.mean(data[order][picked], axis=1))  # as np.median averages the middle two


@functools.lru_cache(maxsize=DRAW_COUNTS_REMEMBERED)
def _drawn(count: int) -> np.ndarray:
    """[position, resample]: how many times the seeded bootstrap draws each of `count` positions. Positions
    are rows so that reordering them by rank moves whole rows."""
    draws = np.random.default_rng(SEED).integers(0, count, size=(RESAMPLES, count))
    flat = (draws + np.arange(RESAMPLES)[:, None] * count).ravel()
    drawn = np.bincount(flat, minlength=RESAMPLES * count).reshape(RESAMPLES, count)
    return np.ascontiguousarray(drawn.T, dtype=np.min_scalar_type(count))  # small: a report's few counts are kept


def _percentile_bounds(estimates: np.ndarray) -> tuple[float, float]:
    """The CONFIDENCE interval's ends among the resamples' estimates."""
    tail = (1 - CONFIDENCE) / 2 * 100
    low, high = np.percentile(estimates, [tail, 100 - tail])
    return float(low), float(high)


def paired_ratio(numerator: Sequence[float], denominator: Sequence[float]) -> Interval:
    """The median of round-by-round ratios numerator[i] / denominator[i] and its interval: how many
    times the denominator's time the numerator took, each round against its own partner."""
    if len(numerator) != len(denominator) or not numerator:
        raise ValueError(f"paired ratio needs rounds of equal count, got {len(numerator)} and {len(denominator)}")
    return median_interval([a / b for a, b in zip(numerator, denominator)])


def cluster_mean_interval(totals: Sequence[float], counts: Sequence[int]) -> tuple[float, float, float]:
    """The mean of observations that come in clusters, sum(totals) / sum(counts) (cluster i: counts[i]
    observations summing to totals[i]), and its percentile-bootstrap interval resampling whole
    clusters: observations within a cluster are correlated (an accuracy window's tokens share their text
    and cache), so resampling them one by one would give an interval too narrow. One cluster: zero width."""
    totals, counts = np.asarray(totals, dtype=np.float64), np.asarray(counts, dtype=np.float64)
    mean = float(totals.sum() / counts.sum())
    if len(totals) < 2:
        return mean, mean, mean
    draws = np.random.default_rng(SEED).integers(0, len(totals), size=(RESAMPLES, len(totals)))
    means = totals[draws].sum(axis=1) / counts[draws].sum(axis=1)
    tail = (1 - CONFIDENCE) / 2 * 100
    low, high = np.percentile(means, [tail, 100 - tail])
    return mean, float(low), float(high)


def cluster_percentile_interval(values: np.ndarray, scored: np.ndarray, q: float) -> tuple[float, float, float]:
    """The q-th percentile of the scored values [clusters, n] pooled (scored: bool [clusters, n]), and its
    percentile-bootstrap interval resampling whole clusters (rows), as cluster_mean_interval does for a
    mean. One cluster: zero width."""
    rows = [row[mask] for row, mask in zip(np.asarray(values, dtype=np.float64), scored) if mask.any()]
    point = float(np.percentile(np.concatenate(rows), q))
    if len(rows) < 2:
        return point, point, point
    draws = np.random.default_rng(SEED).integers(0, len(rows), size=(RESAMPLES, len(rows)))
    estimates = [np.percentile(np.concatenate([rows[i] for i in draw]), q) for draw in draws]
    tail = (1 - CONFIDENCE) / 2 * 100
    low, high = np.percentile(estimates, [tail, 100 - tail])
    return point, float(low), float(high)

"""What the numbers support: which strategy is faster at a point, by how much, and where the run cannot tell.

Every comparison the report draws between two strategies' step times goes through `compare`:
- rows timed in one group (the same `group_id`: one process, steps interleaved round by round) are
  compared round by round, pooled over every group both sit in (a sweep's repeats), with the paired
  ratio's bootstrap interval (harness.measure.intervals);
- rows timed apart (interleave=none, or two runs) get the ratio of their medians with an interval from
  their own intervals' ends, and are marked `apart`: on a shared machine two numbers
  measured minutes apart differ by the machine's drift as much as by the strategies.
A ratio whose interval holds 1 is a tie, never a winner. `verdict` names the fastest strategy of a
point only where its interval clears the next one's, else the members tied within the interval.
A comparison drawing on a row flagged noisy (other processes took the machine while it was timed) is
kept, not dropped: the rounds were still timed together, so the ratio holds with a wider interval; it
reads `noisy` after its figures, so a reader weighs it as such.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from harness.analysis.results import SERIES
from harness.measure.intervals import Interval, median_interval, paired_ratio
from harness.report import units as fmt
from harness.report.document import Paragraph

GROUP = "group_id"
TIMES = "decode_step_times_s"


@dataclass(frozen=True)
class Comparison:
    """Step time of one series over another's at one point."""

    ratio: Interval  # numerator's time / denominator's time
    paired: bool  # from rounds timed together (one group); False: measured apart
    noisy: bool = False  # a row it draws on was flagged noisy: kept, its interval wider, marked

    @property
    def tie(self) -> bool:
        return not self.ratio.excludes(1.0)

    def text(self) -> str:
        """`1.48x [1.41–1.55]`, or `tie (1.02x, 0.97–1.07)`; `apart` when not from rounds timed together,
        `noisy` when a row it draws on was flagged noisy."""
        r = self.ratio
        apart = ("" if self.paired else " apart") + (" noisy" if self.noisy else "")
        if self.tie:
            return f"tie ({fmt.ratio(r.median)}, {r.low:.2f}–{r.high:.2f}){apart}"
        return f"{fmt.ratio(r.median)}{_bounds(r)}{apart}"


def _bounds(interval: Interval) -> str:
    """` [low–high]`, or nothing for an interval of zero width (one value on each side)."""
    return f" [{interval.low:.3g}–{interval.high:.3g}]" if interval.high > interval.low else ""


def ahead(ratio: Interval) -> str:
    """How much faster the fastest is than another whose time is `ratio` times its own: a percentage
    below 2x, a factor above, with the interval where it has one."""
    if ratio.median < 2:
        bounds = f" [{ratio.low - 1:.0%}–{ratio.high - 1:.0%}]" if ratio.high > ratio.low else ""
        return f"{ratio.median - 1:.0%}{bounds} faster"
    return f"{fmt.ratio(ratio.median)}{_bounds(ratio)} faster"


def step_text(step: Interval) -> str:
    """A step time with its interval's half-width, `16.6 ms ±2%` (none where it has no width)."""
    return fmt.seconds(step.median) + (f" ±{step.half_width:.0%}" if step.high > step.low else "")


def _times(rows: pd.DataFrame) -> list[list[float]]:
    """Each row's timed steps (none where the row holds no list). Read from the one column, not row by
    row: a point of a large folder pools dozens of repeats, and each section judges it again."""
    if TIMES not in rows:
        return [[] for _ in range(len(rows))]
    # a row of an older schema, read beside newer ones, holds NaN
    return [[] if times is None or np.ndim(times) != 1 else [float(t) for t in times] for times in rows[TIMES]]


def pooled_step(rows: pd.DataFrame) -> Interval:
    """A series' step time at one point over all its rows (repeats): the median of every timed step,
    with its interval; rows without their steps give their own median and interval."""
    steps = [t for times in _times(rows) for t in times]
    if steps:
        return median_interval(steps)
    row = rows.iloc[0]
    low, high = row.get("decode_step_ci_low_s"), row.get("decode_step_ci_high_s")
    median = float(row["decode_step_s"])
    return Interval(median, float(low) if not fmt.missing(low) else median, float(high) if not fmt.missing(high) else median)


def any_noisy(*frames: pd.DataFrame) -> bool:
    """Whether any row of the frames is flagged noisy."""
    return any(bool(frame["noisy"].fillna(False).astype(bool).any()) for frame in frames if "noisy" in frame)


def compare(numerator: pd.DataFrame, denominator: pd.DataFrame) -> Comparison:
    """numerator's step time over denominator's at one point (rows of one series each)."""
    noisy = any_noisy(numerator, denominator)
    pairs_a, pairs_b = [], []
    if GROUP in numerator and GROUP in denominator:
        partners = {group: times for group, times in zip(denominator[GROUP], _times(denominator))
                    if isinstance(group, str)}
        for group, mine in zip(numerator[GROUP], _times(numerator)):
            theirs = partners.get(group)
            if theirs and mine and len(mine) == len(theirs):
                pairs_a += mine
                pairs_b += theirs
    if pairs_a:
        return Comparison(paired_ratio(pairs_a, pairs_b), paired=True, noisy=noisy)
    a, b = pooled_step(numerator), pooled_step(denominator)
    return Comparison(Interval(a.median / b.median, a.low / b.high, a.high / b.low), paired=False, noisy=noisy)


@dataclass(frozen=True)
class Verdict:
    """Who is fastest at one point, as far as the intervals allow."""

    text: str  # the summary's cell
    fastest: str  # the series with the lowest pooled median
    comparisons: dict  # series -> Comparison against the fastest


def verdict(rows: pd.DataFrame) -> Verdict:
    """The fastest series at one point (rows of several series, any repeats) where its interval clears
    the next one's; else `tie within X%` naming the series whose interval against it holds 1."""
    series = {name: mine for name, mine in rows.groupby(SERIES)}
    medians = {name: pooled_step(mine).median for name, mine in series.items()}
    order = sorted(medians, key=medians.get)
    fastest = order[0]
    comparisons = {name: compare(series[name], series[fastest]) for name in order[1:]}
    if not comparisons:
        return Verdict(fastest, fastest, comparisons)
    tied = [name for name in order[1:] if comparisons[name].tie]
    apart = ("" if all(c.paired for c in comparisons.values()) else ", apart") + \
        (", noisy" if any(c.noisy for c in comparisons.values()) else "")
    if not tied:
        second = order[1]
        return Verdict(f"{fastest} ({ahead(comparisons[second].ratio)} than {second}{apart})", fastest, comparisons)
    within = max(comparisons[name].ratio.high for name in tied) - 1
    return Verdict(f"tie within {within:.0%}: {', '.join([fastest, *tied])}{f' ({apart[2:]})' if apart else ''}",
                   fastest, comparisons)


def resolution(verdicts: list[Verdict], noisy: bool = False) -> tuple[float, int] | None:
    """The difference this run could resolve: the median half-width of its paired ratio intervals (a
    fraction), and how many comparisons it is taken over, among the comparisons that are noisy or not
    as `noisy` says; None without such a paired comparison."""
    widths = sorted(c.ratio.half_width for v in verdicts for c in v.comparisons.values()
                    if c.paired and c.noisy == noisy)
    if not widths:
        return None
    return widths[len(widths) // 2], len(widths)


def resolution_paragraph(verdicts: list[Verdict]) -> Paragraph:
    """The paragraph under the summary: the smallest difference this run could resolve, and why, from
    the quiet comparisons and, apart, from those drawing on noisy rows (wider)."""
    found, noisy = resolution(verdicts), resolution(verdicts, noisy=True)
    if noisy is not None:
        width, count = noisy
        quiet = "" if found is None else (f"**Resolution: about ±{found[0]:.1%}** over the {found[1]} ratio(s) of "
                                          "quiet rows (median half-width of their 95% intervals, paired rounds). ")
        return Paragraph(
            f"{quiet}**{count} ratio(s) draw on noisy rows** (marked `noisy`): timed in the same rounds, so the ratio "
            f"still holds, but over a busy machine's rounds: their median half-width is ±{width:.1%}. A difference "
            "inside that is reported as a tie; re-run on a quiet machine to narrow it.")
    if found is None:
        return Paragraph("No two strategies were timed in the same rounds here, so no difference between them is "
                         "resolved: rows timed apart differ by the machine's drift between them as much as by the "
                         "strategies (interleave=shape, the default, times a shape's strategies together).")
    width, count = found
    return Paragraph(
        f"**Resolution: about ±{width:.1%}.** That is the median half-width of the 95% intervals of the "
        f"{count} step-time ratios above, each over paired rounds of strategies timed together (bootstrap "
        f"over rounds); differences smaller than that are reported as ties, not as a winner. More rounds "
        f"(`decode_tokens=`) or `repeats=` narrow it; a quieter machine too.")

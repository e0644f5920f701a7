"""The section "what compressing the cache trades": per point where a cache ran that keeps fewer tokens,
layers or key channels than the exact one (eviction, cross-layer sharing, key-channel pruning, alone or
over a narrower format), the trade-off of every cache variant there against the exact cache.

It leads with the picture: per context, bytes held (measured, ÷ the exact cache's) against quality,
one panel per measure: mean KL from the exact reference, the perplexity ratio on the prompt's text, and
the recall probe's top-1 (harness.measure.accuracy: a span of the prompt repeated beyond every budget,
which a dropped token fails while prose perplexity barely sees it), one marker per variant, bars its
95% interval. The table then sets beside each variant its step time against the exact cache's
(paired rounds) and the predicted ratio, calling out a measured interval that excludes the prediction,
and says what any compression could buy at the point at all: the exact cache's share of the step's
bytes (`cache_share_of_step_bytes`) and the context at which this batch's cache, as each variant stores
it, weighs the weights read (`context_to_match_weights`).

Every figure comes from the rows' columns; the predicted ratio is the two rows' `predicted_step_s`
where they have one, else their analytic bytes per step (`bytes_per_step_model`: the ratio a
memory-bound step shows).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import pandas as pd

from harness.analysis.results import SERIES
from harness.measure.intervals import Interval
from harness.report import units as fmt
from harness.report.cohorts import Cohort, cached_rows, newest_per_point
from harness.report.document import Block, Figure, Heading, Paragraph, Table
from harness.report.figures import MARKERS, PALETTE, legend_outside, new_figure, save, title
from harness.report.kv_formats import weights_note
from harness.report.tradeoff import flag, interval, point_ratio, ran_rows, reference_series, value
from harness.report.verdicts import Comparison

AXES = ("cache_token_budget", "cache_layers_stored", "cache_key_channels_kept")  # > 0: the axis is compressed
QUALITY = (  # (row column, its interval's columns, the panel's label)
    ("logit_kl_mean", "logit_kl_mean_ci_low", "logit_kl_mean_ci_high", "mean KL from the exact cache, nats"),
    ("perplexity_ratio", "perplexity_ratio_ci_low", "perplexity_ratio_ci_high", "perplexity ÷ exact cache's"),
    ("recall_top1", "recall_top1_ci_low", "recall_top1_ci_high", "recall probe: top-1 on the repeated span"),
)
MAX_PLOTS = 16  # trade-off plots per cohort, one per point
HEADER = ["variant", "bytes held ÷ exact", "step ÷ exact [95%]", "step ÷ exact, predicted", "KL mean [95%]", "KL p99 [95%]",
          "same top-1 [95%]", "perplexity ratio [95%]", "recall top-1 [95%]", "recall KL [95%]",
          "cache = weights at ctx"]
CAPTION = ("Cache bytes held at the end of the point, measured, ÷ the exact cache's, "
           "against each quality measure; bars: 95% intervals over the accuracy windows. The recall panel's dotted "
           "line is the exact cache's own score on the probe (what a cache that kept every token reaches).")


@dataclass(frozen=True)
class Variant:
    """One cache variant at one point, beside the exact cache timed in the same group."""

    series: str
    held_ratio: Optional[float]  # kv_cache_bytes (measured) ÷ the exact cache's
    step: Optional[Comparison]  # measured step ÷ the exact cache's, paired; None for the exact cache itself
    predicted: Optional[float]  # predicted step ÷ the exact cache's
    quality: dict  # QUALITY column -> Interval or None
    row: pd.Series


def compressed(rows: pd.DataFrame) -> pd.Series:
    """Rows of caches that keep fewer tokens, layers or key channels than the sequence has."""
    found = pd.Series(False, index=rows.index)
    for axis in AXES:
        if axis in rows:
            found |= rows[axis].fillna(0).astype(float) > 0
    return found


def _predicted(row, reference) -> Optional[float]:
    for column in ("predicted_step_s", "bytes_per_step_model"):
        mine, theirs = value(row, column), value(reference, column)
        if mine is not None and theirs:
            return mine / theirs
    return None


def variants_at(ran: pd.DataFrame, reference: str) -> list[Variant]:
    """Every cached variant of one point (rows of one batch and ctx), the exact cache first."""
    cached = cached_rows(ran)
    exact = cached[cached[SERIES] == reference]
    if exact.empty:
        return []
    base = exact.iloc[0]
    found = []
    for _, row in newest_per_point(cached, [SERIES]).iterrows():  # repeats: one line, the step pooled
        held, base_held = value(row, "kv_cache_bytes"), value(base, "kv_cache_bytes")
        is_reference = row[SERIES] == reference
        found.append(Variant(
            series=str(row[SERIES]), held_ratio=held / base_held if held is not None and base_held else None,
            step=None if is_reference else point_ratio(cached, row[SERIES], reference),
            predicted=None if is_reference else _predicted(row, base),
            quality={column: interval(row, column, low, high) for column, low, high, _ in QUALITY}, row=row))
    return sorted(found, key=lambda v: (v.series != reference, v.held_ratio or 0, v.series))


def _cell(found: Optional[Interval], digits: str) -> str:
    if found is None:
        return "–"
    bounds = f" [{found.low:{digits}}–{found.high:{digits}}]" if found.high > found.low else ""
    return f"{found.median:{digits}}{bounds}"


def _tokens(count: Optional[float]) -> str:
    return "never (the budget holds it below)" if count is None else f"{count:,.0f}"


def table_row(v: Variant) -> list[str]:
    row = v.row
    if v.step is None:
        step, predicted = "reference", "–"
    else:
        step = v.step.text()  # a ratio drawing on a noisy row is kept and says `noisy`
        predicted = "–" if v.predicted is None else fmt.ratio(v.predicted)
        if v.predicted is not None and not flag(row, "noisy") and v.step.ratio.excludes(v.predicted):
            predicted += " **outside**"
    exact = bool(row.get("exact"))
    quality = ["exact"] * 6 if exact else [
        _cell(v.quality["logit_kl_mean"], ".2g"),
        _cell(interval(row, "logit_kl_p99", "logit_kl_p99_ci_low", "logit_kl_p99_ci_high"), ".2g"),
        _cell(interval(row, "top1_agreement", "top1_agreement_ci_low", "top1_agreement_ci_high"), ".3f"),
        _cell(v.quality["perplexity_ratio"], ".3f"), _cell(v.quality["recall_top1"], ".3f"),
        _cell(interval(row, "recall_kl_mean", "recall_kl_mean_ci_low", "recall_kl_mean_ci_high"), ".2g")]
    held = "–" if v.held_ratio is None else fmt.ratio(v.held_ratio)
    return [f"`{v.series}`", held, step, predicted, *quality, _tokens(value(row, "context_to_match_weights"))]


def _style(index: int) -> dict:
    """A marker and colour per variant, distinct for up to len(MARKERS) x len(PALETTE) of them."""
    return {"fmt": MARKERS[(index + 3 * (index // len(MARKERS))) % len(MARKERS)], "color": PALETTE[index % len(PALETTE)]}


def tradeoff_plot(label: str, found: list[Variant], name: str, heading: str, folder: Path) -> Optional[Path]:
    """Bytes held against each quality measure at one point, one marker per variant with its interval;
    the exact cache marks perplexity ratio 1 (KL 0 has no place on a log axis, and its recall is the
    dotted line)."""
    names = sorted(v.series for v in found)
    fig, axes = new_figure(4.0 * len(QUALITY) + 2.4, 3.8, columns=len(QUALITY), squeeze=False)
    for ax, (column, _, _, ylabel) in zip(axes[0], QUALITY):
        for v in found:
            measured = v.quality[column]
            if bool(v.row.get("exact")) and column == "perplexity_ratio":
                measured = Interval(1.0, 1.0, 1.0)
            if v.held_ratio is None or measured is None:
                continue
            y = measured.median
            ax.errorbar([v.held_ratio], [y], yerr=[[max(y - measured.low, 0)], [max(measured.high - y, 0)]], ms=7,
                        capsize=3, label=v.series, **_style(names.index(v.series)))
        if column in ("logit_kl_mean", "perplexity_ratio") and ax.has_data():
            ax.set_yscale("log")
        if column == "recall_top1":
            exact_recall = [r for r in (value(v.row, "recall_top1_reference") for v in found) if r is not None]
            if exact_recall:
                ax.axhline(max(exact_recall), color="#777", ls=":", lw=1, label="exact cache's recall")
        ax.set_xlabel("cache bytes held ÷ exact cache's")
        ax.set_ylabel(ylabel, fontsize=8)
        ax.grid(True, alpha=0.3)
    legend_outside(fig, axes[0], "variant")
    title(fig, f"What compressing the cache trades: bytes held against quality, {label}\n{heading}")
    return save(fig, folder, name)


def _point_paragraph(found: list[Variant], batch: int, ctx: int) -> str:
    exact = found[0].row
    share, crossover = value(exact, "cache_share_of_step_bytes"), value(exact, "context_to_match_weights")
    parts = []
    if share is not None:
        parts.append(f"The exact cache is {share:.1%} of a step's bytes here: no compression of it can make the step "
                     f"faster than {1 - share:.3f}x the exact one's (a memory-bound step).")
    if crossover is not None:
        side = "past" if ctx >= crossover else "short of"
        parts.append(f"At this batch it weighs the weights a step reads at ctx {crossover:,.0f}; this point is {side} it.")
    outside = [v for v in found if v.step is not None and v.predicted is not None and not flag(v.row, "noisy")
               and v.step.ratio.excludes(v.predicted)]
    if outside:
        parts.append("Measured step ratios whose interval excludes the prediction: " + "; ".join(
            f"`{v.series}` {v.step.text()} against {fmt.ratio(v.predicted)} predicted" for v in outside)
            + " (what the bytes do not count: scoring, gathers, a slower kernel, or a step bound by other work).")
    return " ".join(parts)


HEADING = "What compressing the cache trades"


def compression_section(cohorts: list[Cohort], folder: Path) -> list[Block]:
    out: list[Block] = []
    for cohort in cohorts:
        ran = ran_rows(cohort)
        if ran.empty or not compressed(ran).any():
            continue
        reference = reference_series(ran)
        blocks: list[Block] = []
        for (batch, ctx), here in ran.groupby(["batch", "ctx"], sort=True):
            found = variants_at(here, reference) if compressed(here).any() and reference is not None else []
            if not found:
                continue
            label = f"batch {batch:,}, ctx {ctx:,}"
            drawn = sum(isinstance(block, Figure) for block in blocks)
            picture: Block = (Figure(tradeoff_plot(label, found, f"compression_{cohort.slug}_b{batch}_ctx{ctx}.png",
                                                   cohort.title, folder), CAPTION) if drawn < MAX_PLOTS else
                              Paragraph(f"*(plot omitted: the first {MAX_PLOTS} points of this cohort are drawn, so "
                                        "that a folder of many points stays bounded; the table holds this one)*"))
            blocks += [Heading(label, 4), picture, Paragraph(_point_paragraph(found, batch, ctx)),
                       Table(HEADER, [table_row(v) for v in found], [False] + [True] * 10)]
        if blocks:
            out += [Heading(cohort.title, 3), Paragraph(weights_note(cohort)), *blocks]
    if not out:
        return [Heading(HEADING), Paragraph("No cache that keeps fewer tokens, layers or key channels ran here: "
                          "`python -m harness.run +sweep=kv_compression` puts eviction, cross-layer sharing and "
                          "key-channel pruning beside the exact cache on a real model.")]
    return [Heading(HEADING), Paragraph(
        "Caches that keep fewer tokens (eviction), layers (cross-layer sharing) or key channels (pruning) than the "
        "exact cache, beside it at the same points. Quality over teacher-forced tokens scored after each budget "
        "filled: mean KL from the exact reference, its p99, the share with the same top-1, the perplexity ratio on "
        "the prompt's text, and the recall probe (a span of the prompt repeated further back than any budget: "
        "a dropped token fails it, while prose perplexity mostly rewards the recent tokens every policy keeps). "
        "Step ratios are paired over rounds timed together; the predicted ratio is the analytic model's, and "
        "**outside** marks a measured interval that excludes it.")] + out

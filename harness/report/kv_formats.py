"""The section "what fewer bytes buy": per cohort where a cache stored below the compute dtype's width
(or any approximate cache) ran, one table and one plot of the trade-off. The table sets every cache
variant of those points beside the exact reference cache: bytes held per token, the step time against
the reference's (paired rounds of one group), and how far its outputs moved (KL divergence with its
interval, p99 and max; same top-1; the perplexity ratio on a prompt file's text); exact variants read
"exact". The plot puts bytes per token against mean KL, log axes, intervals as error bars, with the
Pareto front drawn (harness.report.tradeoff computes every figure). Each cohort says where its accuracy
came from: a checkpoint's weights, or seeded random ones, which do not predict a real model's.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from harness.report import units as fmt
from harness.report.cohorts import Cohort
from harness.report.document import Block, Figure, Heading, Paragraph, Table
from harness.report.figures import MARKERS, PALETTE, in_units, legend_outside, log_scale, new_figure, save, title
from harness.report.tradeoff import (FrontPoint, VariantPoint, front_points, missing_columns, narrow_or_approximate,
                                     pareto_front, ran_rows, reference_series, variant_points)

HEADER = ["variant", "class", "batch", "ctx", "bytes/token", "bytes/token ÷ exact", "step ÷ exact [95%]", "step ÷ exact, roofline",
          "KL mean [95%], nats", "KL p99", "KL max", "same top-1", "perplexity ratio [95%]", "tokens scored (after ctx)",
          "Pareto front"]
RANDOM_WEIGHTS_WARNING = (
    "Random weights do not predict real accuracy: a real model's keys carry a few outlier channels, which "
    "per-token scales quantize worst (the reason KIVI scales keys per channel), and random keys have none. "
    "Judge a format on a checkpoint and real text: `model.checkpoint=PATH prompt=PATH` (docs/method.md).")
FRONT_CAPTION = (
    "Bytes per token held once the scored tokens have followed the context (payload, scales and the full-width "
    "window, analytic: a windowed cache's figure can differ a little from the table's, taken at the point's own "
    "length) against the mean KL divergence from the exact reference per scored token, log axes; bars: the KL's "
    "95% interval. Filled markers sit on the "
    "Pareto front (no variant holds fewer bytes with as little KL), joined by the dashed line; hollow ones are "
    "beaten on both. Exact variants (KL 0) sit on the bottom line.")


def weights_note(cohort: Cohort) -> str:
    """Where the cohort's accuracy figures came from: random weights (with the warning), a checkpoint
    (its folder and hash) and the prompt (a file, or random ids)."""
    rows = narrow_or_approximate(ran_rows(cohort))
    weights = rows["weights"]
    parts = []
    if (weights == "checkpoint").any():
        checkpoints = rows.loc[weights == "checkpoint", ["checkpoint", "checkpoint_hash"]].drop_duplicates()
        parts.append("Accuracy from a checkpoint's weights: " + ", ".join(
            f"`{c.checkpoint}` (hash {c.checkpoint_hash})" for c in checkpoints.itertuples()) + ".")
    if (weights == "random").any():
        parts.append(("Some of these rows have" if parts else "Accuracy from") + " seeded random weights. "
                     + RANDOM_WEIGHTS_WARNING)
    prompts = rows["prompt"].dropna().unique()
    parts.append(f"Prompts and scored text from {', '.join(f'`{p}`' for p in prompts)}." if len(prompts) else
                 "Prompts were seeded random token ids, so no perplexity was measured.")
    if len(prompts) and (reference := _reference_perplexities(rows)):
        parts.append(f"The exact cache's perplexity on it: {reference} (the ratios below divide by it).")
    return " ".join(parts)


def _reference_perplexities(rows: pd.DataFrame) -> str:
    """The reference's perplexity per context its scored tokens followed, e.g. "9.734 after ctx 512";
    empty where no row recorded one."""
    found = rows.assign(after=rows["accuracy_ctx"]).dropna(subset=["perplexity_reference", "after"])
    by_context = found.groupby("after")["perplexity_reference"].median()
    return ", ".join(f"{perplexity:.4g} after ctx {int(after)}" for after, perplexity in by_context.items())


def _with_interval(middle: float, low: float, high: float, digits: str) -> str:
    bounds = f" [{low:{digits}}–{high:{digits}}]" if high > low else ""
    return f"{middle:{digits}}{bounds}"


def _number(value, digits: str = ".3g") -> str:
    return "–" if value is None else f"{value:{digits}}"


def front_cell(point: VariantPoint, front: set, contexts: list[int]) -> str:
    """Whether the variant is on the Pareto front after the context its accuracy followed; an exact one
    after each context any was measured after ("yes" after all, else which)."""
    mine = [ctx for ctx in contexts if (ctx, point.series) in front]
    if not point.accuracy.exact:
        return "yes" if point.accuracy_ctx in mine else ""
    if not mine or mine == contexts:
        return "yes" if mine else ""
    return ", ".join(f"after {ctx:,}" for ctx in mine)


def table_row(point: VariantPoint, front: set, contexts: list[int]) -> list[str]:
    accuracy = point.accuracy
    if point.is_reference:
        step = "reference"
    else:  # a noisy row's paired ratio is kept: its text says `noisy`
        step = "–" if point.step is None else point.step.text()
    if accuracy.exact:
        kl = perplexity = "exact"
    else:
        kl = "–" if accuracy.kl is None else _with_interval(accuracy.kl.median, accuracy.kl.low, accuracy.kl.high, ".2g")
        perplexity = "–" if accuracy.perplexity is None else _with_interval(
            accuracy.perplexity.median, accuracy.perplexity.low, accuracy.perplexity.high, ".4f")
    scored = "–" if accuracy.tokens is None else f"{accuracy.tokens:,} (after {point.accuracy_ctx:,})"
    return [point.series, point.family, fmt.count(point.batch), fmt.count(point.ctx), fmt.nbytes(point.bytes_per_token),
            fmt.ratio(point.bytes_ratio), step, fmt.ratio(point.predicted), kl, _number(accuracy.kl_p99),
            _number(accuracy.kl_max), _number(accuracy.top1), perplexity, scored, front_cell(point, front, contexts)]


def front_plot(cohort: Cohort, found: list[FrontPoint], front: set, folder: Path) -> Path | None:
    """Bytes per token against mean KL, one panel per context the accuracy followed, the front drawn."""
    if not found:
        return None
    contexts = sorted({p.accuracy_ctx for p in found})
    names = sorted({p.series for p in found})
    measured = [v for p in found if not p.accuracy.exact for v in (p.accuracy.kl.low, p.accuracy.kl.median)]
    floor = min(v for v in measured if v > 0) / 10 if any(v > 0 for v in measured) else 1e-6
    fig, axes = new_figure(4.6 * len(contexts) + 2.2, 4.6, columns=len(contexts), squeeze=False, sharey=True)
    for ax, ctx in zip(axes[0], contexts):
        here = [p for p in found if p.accuracy_ctx == ctx]
        for p in here:
            i, kl = names.index(p.series), max(p.accuracy.kl_or_zero, floor)
            err = None if p.accuracy.exact else [[max(kl - max(p.accuracy.kl.low, floor), 0)],
                                                 [max(p.accuracy.kl.high - kl, 0)]]
            colour = PALETTE[i % len(PALETTE)]
            ax.errorbar([p.bytes_per_token], [kl], yerr=err, fmt=MARKERS[i % len(MARKERS)], ms=8, capsize=3, color=colour,
                        mfc=colour if (ctx, p.series) in front else "white",
                        label=f"{p.series} (exact)" if p.accuracy.exact else p.series)
        line = sorted((p.bytes_per_token, max(p.accuracy.kl_or_zero, floor)) for p in here if (ctx, p.series) in front)
        if len(line) > 1:
            ax.plot(*np.array(line).T, "--", color="#555", lw=1.0, zorder=0, label="Pareto front")
        ax.axhline(floor, color="#999", ls=":", lw=0.8)
        ax.annotate("exact: KL 0", (0.02, floor), xycoords=("axes fraction", "data"), xytext=(0, 3),
                    textcoords="offset points", fontsize=7, color="#666")  # left: exact caches hold the most bytes
        log_scale(ax, "x", in_units("B"))
        log_scale(ax, "y", lambda v: f"{v:g}")
        ax.set_ylim(bottom=floor / 2)
        ax.set_title(f"KL over the tokens after ctx {ctx:,}", fontsize=9)
        ax.set_xlabel("cache bytes per token held")
        ax.grid(True, which="major", alpha=0.3)
    axes[0][0].set_ylabel("mean KL(reference ‖ variant), nats")
    legend_outside(fig, axes[0], "filled: on the front")
    title(fig, f"What fewer bytes buy: bytes per token against accuracy\n{cohort.title}")
    return save(fig, folder, f"bytes_vs_kl_{cohort.slug}.png")


def front_sentence(found: list[FrontPoint], front: set) -> str:
    """The front after each context, from the fewest bytes; variants equal on both axes named together."""
    parts = []
    for ctx in sorted({c for c, _ in front}):
        members: dict[tuple[float, float], list[FrontPoint]] = {}
        for p in sorted(found, key=lambda p: (p.bytes_per_token, p.series)):
            if p.accuracy_ctx == ctx and (ctx, p.series) in front:
                members.setdefault((p.bytes_per_token, p.accuracy.kl_or_zero), []).append(p)
        parts.append(f"after ctx {ctx:,}: " + ", ".join(
            f"{', '.join(f'`{p.series}`' for p in same)} ({fmt.nbytes(per_token)}/token, "
            f"{'exact' if kl == 0 else 'KL ' + format(kl, '.2g')})" for (per_token, kl), same in members.items()))
    return ("**On the Pareto front** of bytes against KL, " + "; ".join(parts) + ". Every other variant holds as many "
            "bytes or more for as much KL or more.")


def _cohort_blocks(cohort: Cohort, folder: Path) -> list[Block]:
    ran = ran_rows(cohort)
    reference = reference_series(ran)
    points = variant_points(cohort)
    out: list[Block] = [Heading(cohort.title, 3), Paragraph(weights_note(cohort))]
    if not points:
        return out + [Paragraph("No exact cache ran beside these narrow caches, so there is nothing to set their bytes, "
                                "speed and accuracy against: add `strategy=contiguous` to the sweep.")]
    missing = missing_columns(cohort, reference)
    if missing:
        out.append(Paragraph("Not recorded in these rows (written before the harness measured them, or without an "
                             f"accuracy pass): {', '.join(f'`{c}`' for c in missing)}; their cells read –."))
    found = front_points(points)
    front = pareto_front(found)
    contexts = sorted({p.accuracy_ctx for p in found})
    out += [Paragraph(f"Ratios against `{reference}`, the exact cache measured in the same rounds."),
            Table(HEADER, [table_row(p, front, contexts) for p in points], [False, False] + [True] * 12 + [False])]
    if front:
        out.append(Paragraph(front_sentence(found, front)))
    path = front_plot(cohort, found, front, folder)
    out.append(Figure(path, FRONT_CAPTION) if path is not None else
               Paragraph(f"*(plot omitted: no approximate variant here has a measured KL: {_why_unscored(cohort)})*"))
    return out


def _why_unscored(cohort: Cohort) -> str:
    """Why the cohort's approximate variants scored nothing, as their rows say."""
    rows = narrow_or_approximate(ran_rows(cohort))
    if len(rows) and (rows["prefill"] == "random").all():
        return "with prefill=random no prompt runs, so nothing is scored"
    reasons = rows["accuracy_reference"].dropna().unique()
    return ("the accuracy pass did not run: " + "; ".join(map(str, reasons))) if len(reasons) else \
        "no accuracy pass ran for these rows"


def format_section(cohorts: list[Cohort], folder: Path) -> list[Block]:
    out: list[Block] = [Heading("What fewer bytes buy"), Paragraph(
        "Per group where a cache stored below the compute dtype's width (or an approximate one) ran: every cache "
        "variant at those points beside the exact reference cache. Bytes per token held at the point's length "
        "(payload, scales and the full-width window, analytic); the step time against the reference's, paired "
        "over rounds timed together (a tie where the interval holds 1), and the roofline's ratio from each "
        "layout's bytes; how far the outputs moved over teacher-forced tokens: mean KL divergence from the "
        "reference with its 95% interval, its p99 and max, the share with the same top-1 token, and with a "
        "prompt file the perplexity ratio on its text. Exact variants read `exact`.")]
    shown = False
    for cohort in cohorts:
        if narrow_or_approximate(ran_rows(cohort)).empty:
            continue
        shown = True
        out += _cohort_blocks(cohort, folder)
    if not shown:
        out.append(Paragraph("No quantized cache ran beside the plain cache here, e.g. "
                             "`python -m harness.run -m strategy=quantized strategy.format=int8,int4,fp8_e4m3` and "
                             "`strategy=contiguous` at the same batch and ctx."))
    return out

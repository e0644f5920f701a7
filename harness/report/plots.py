"""The report's plots, one function each: measured points against analytic lines, saved as PNGs.

Every function takes one Cohort (one model, device, dtype) and the folder to write to, and returns the
path of the PNG, or None when the rows at hand cannot show what the plot is about (the report then
says so instead of drawing an empty frame). One exception: comparison_ratios draws the points two runs
share (harness.report.compare), which span cohorts.

Rows flagged noisy are drawn, hollow and named so, wherever a plot shows ratios between members timed
in the same rounds or memory (Cohort.timed); only the step-time plot, which sets absolute times against
the roofline, draws the quiet rows alone (Cohort.ok).
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import matplotlib.ticker
import numpy as np
import pandas as pd

from harness.report.cohorts import Cohort, cached_rows, newest_per_point, ordered_strategies, recompute_rows, SERIES
from harness.report.figures import (MARKERS, PALETTE, RECOMPUTE_COLOUR, as_ratio, in_units, legend_outside, log_scale,
                                    new_figure, save, title)
from harness.report.tradeoff import point_ratio, reference_series

STRATEGY_COLOURS = PALETTE
OTHER_COLOUR = "#7f7f7f"  # a series that is neither the reference nor a cache
MAX_BARS = 80  # bars one plot draws: a folder of thousands of points draws the first ones and says so
BATCH_COLOURS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#17becf"]


def _colours(cohort: Cohort) -> dict[str, str]:
    """One colour per strategy within a cohort, the same in every plot of it (the recompute reference's red)."""
    recomputes, caches = set(recompute_rows(cohort.rows)[SERIES]), set(cached_rows(cohort.rows)[SERIES])
    cached = [s for s in ordered_strategies(cohort.rows) if s in caches]
    colours = {s: STRATEGY_COLOURS[i % len(STRATEGY_COLOURS)] for i, s in enumerate(cached)}
    return {**colours, **dict.fromkeys(recomputes, RECOMPUTE_COLOUR)}


def floats(values) -> np.ndarray:
    """Numbers as floats, NaN for what is missing (None, pandas' NA of a nullable column)."""
    return pd.to_numeric(pd.Series(list(values), dtype=object), errors="coerce").to_numpy(dtype=float, copy=True)


def positive(rows, *columns):
    """The rows whose `columns` are all finite and above 0: what a log axis can draw."""
    keep = np.ones(len(rows), dtype=bool)
    for column in columns:
        values = floats(rows[column]) if column in rows else np.full(len(rows), np.nan)
        keep &= np.isfinite(values) & (values > 0)
    return rows[keep]


def _context_axis(ax, ctxs) -> None:
    """Log x axis ticked at the contexts that were measured, labelled in plain numbers."""
    ticks = sorted({int(c) for c in ctxs})
    ax.set_xscale("log")
    ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    ax.set_xticks(ticks, [f"{t:,}" for t in ticks])


def _line(cohort: Cohort, series, batch, column: str, ctxs) -> tuple[np.ndarray, np.ndarray]:
    """The analytic line of a series at a batch (Cohort.line), over the measured contexts `ctxs` and a
    little beyond each end."""
    grid, values = cohort.line(series, batch, column)
    keep = (grid >= min(ctxs) / 1.5 - 1) & (grid <= max(ctxs) * 1.5)
    return grid[keep], values[keep]


def step_time_vs_context(cohort: Cohort, folder: Path, cached_only: bool = False) -> Optional[Path]:
    """Decode step time against context, one panel per batch: points measured, lines the roofline.
    cached_only: the caches alone (the layouts compared), without the recompute reference."""
    ok = cohort.ok  # every step time in it is finite and above 0 (cohorts.usable_step)
    if cached_only:
        ok = cached_rows(ok)
    if ok.empty:
        return None
    batches = sorted(ok["batch"].unique())
    fig, axes = new_figure(4.2 * len(batches) + 2.4, 4.2, columns=len(batches), squeeze=False, sharey=True)
    colours = _colours(cohort)
    for ax, batch in zip(axes[0], batches):
        rows = ok[ok["batch"] == batch]
        for strategy in ordered_strategies(ok):
            mine = rows[rows[SERIES] == strategy].sort_values("ctx")
            if mine.empty:
                continue
            ax.plot(*_line(cohort, strategy, batch, "predicted_step_s", ok["ctx"]), "-", color=colours.get(strategy, OTHER_COLOUR), alpha=0.55, lw=1.6)
            err = None
            bounds = [(low, high) for low, high in (("decode_step_ci_low_s", "decode_step_ci_high_s"),
                                                    ("decode_step_p10_s", "decode_step_p90_s"))
                      if {low, high} <= set(mine.columns) and mine[low].notna().any()]
            if bounds:  # the step's 95% interval where the rows have one, else its p10-p90 spread
                low_column, high_column = bounds[0]
                low = (mine["decode_step_s"] - mine[low_column]).clip(lower=0).fillna(0)
                high = (mine[high_column] - mine["decode_step_s"]).clip(lower=0).fillna(0)
                err = [low.to_numpy(float), high.to_numpy(float)]
            ax.errorbar(mine["ctx"], mine["decode_step_s"], yerr=err, fmt="o", color=colours.get(strategy, OTHER_COLOUR),
                        ms=5, capsize=2, label=strategy)
        _context_axis(ax, ok["ctx"])
        log_scale(ax, "y", in_units("s"))
        ax.set_title(f"batch {batch}")
        ax.set_xlabel("context (tokens before the first decode step)")
        ax.grid(True, which="major", alpha=0.3)
    axes[0][0].set_ylabel("decode step time")
    axes[0][0].plot([], [], "-", color="#888", label="roofline (lines)")  # legend entry for the lines
    legend_outside(fig, axes[0], "dots: measured (bars: 95% interval)")
    title(fig, f"Decode step time: measured points, roofline prediction lines ({cohort.roof_source} roof)\n{cohort.title}")
    return save(fig, folder, f"step_time_{'layouts_' if cached_only else ''}{cohort.slug}.png")


def no_cache_over_cache(cohort: Cohort, folder: Path) -> Optional[Path]:
    """FLOP ratio, roofline time ratio and measured time ratio of no cache over cache, across context;
    a measured ratio drawing on a noisy row hollow."""
    ok = cohort.timed  # every step time in it is finite and above 0 (cohorts.usable_step)
    cached_name = cohort.plain_cache()
    if cached_name is None or recompute_rows(ok).empty:
        return None
    recompute = sorted(recompute_rows(ok)[SERIES].unique())[0]  # the no-cache line: any recompute reference's
    batches = sorted(ok["batch"].unique())
    fig, ax = new_figure(10.5, 5.0)
    grid, full_flops = _line(cohort, recompute, batches[0], "flops_per_step_model", ok["ctx"])
    flop_ratio = full_flops / _line(cohort, cached_name, batches[0], "flops_per_step_model", ok["ctx"])[1]
    ax.plot(grid, flop_ratio, "-", color="black", lw=2.2, label="FLOP ratio (analytic, any batch)")
    for i, batch in enumerate(batches):
        colour = BATCH_COLOURS[i % len(BATCH_COLOURS)]
        grid, full_step = _line(cohort, recompute, batch, "predicted_step_s", ok["ctx"])
        time_ratio = full_step / _line(cohort, cached_name, batch, "predicted_step_s", ok["ctx"])[1]
        ax.plot(grid, time_ratio, "--", color=colour, lw=1.4, label=f"roofline time ratio, batch {batch}")
        for j, strategy in enumerate(ordered_strategies(cached_rows(ok))):
            noisy = noisy_contexts(ok, int(batch), strategy)
            for hollow in (False, True):
                pairs = [(c, r) for c, r in measured_ratio(ok, int(batch), strategy) if (c in noisy) == hollow]
                if pairs:
                    ax.plot(*zip(*pairs), MARKERS[j % len(MARKERS)], color=colour, ms=7, mfc="none" if hollow else colour,
                            label=f"measured, {strategy}, batch {batch}{' (noisy)' if hollow else ''}")
    ax.axhline(1.0, color="#999", lw=0.8)
    _context_axis(ax, ok["ctx"])
    log_scale(ax, "y", as_ratio)
    ax.set_xlabel("context (tokens before the first decode step)")
    recomputes = ", ".join(sorted(recompute_rows(ok)[SERIES].unique()))
    ax.set_ylabel(f"{recomputes} ÷ cache, per decode step")
    ax.grid(True, which="major", alpha=0.3)
    legend_outside(fig, [ax])
    title(fig, f"What a cache saves: FLOPs (black) against time (dashed: roofline of {cached_name}, "
               f"markers: measured per cache)\n{cohort.title}")
    return save(fig, folder, f"no_cache_over_cache_{cohort.slug}.png")


def measured_ratio(ok, batch: int, cached_name: str) -> list[tuple[int, float]]:
    """(ctx, recompute reference's step time / cached step time) where both ran at this batch."""
    rows = ok[ok["batch"] == batch]
    slow = recompute_rows(rows).groupby("ctx")["decode_step_s"].median()
    fast = rows[rows[SERIES] == cached_name].groupby("ctx")["decode_step_s"].median()
    both = slow.index.intersection(fast.index)
    return [(int(c), float(slow[c] / fast[c])) for c in sorted(both)]


def noisy_contexts(rows, batch: int, cached_name: str) -> set[int]:
    """The contexts at which a recompute reference's or `cached_name`'s row at this batch is flagged noisy."""
    mine = rows[(rows["batch"] == batch) & (rows[SERIES].isin([cached_name, *recompute_rows(rows)[SERIES]]))]
    return {int(c) for c in mine.loc[mine["noisy"].astype(bool), "ctx"]} if "noisy" in mine else set()


def step_ratio_vs_context(cohort: Cohort, folder: Path) -> Optional[Path]:
    """Each member's step time ÷ its group's reference cache's (paired over rounds timed together, bars
    their 95% interval) against context, one panel per batch; a ratio drawing on a noisy row hollow.
    The plot a busy machine does not break: the members of a round share the load."""
    timed = cohort.timed
    reference = reference_series(timed)
    if reference is None or timed[SERIES].nunique() < 2:
        return None
    found = [(row, ratio) for (_, _), at_point in timed.groupby(["batch", "ctx"], sort=True)
             for series, row in at_point.drop_duplicates(SERIES).set_index(SERIES, drop=False).iterrows()
             if series != reference and (ratio := point_ratio(at_point, series, reference)) is not None]
    if not found:  # one marker per series and point, repeats pooled: a folder of thousands stays one plot
        return None
    batches = sorted({row["batch"] for row, _ in found})
    fig, axes = new_figure(4.2 * len(batches) + 2.6, 4.2, columns=len(batches), squeeze=False, sharey=True)
    colours = _colours(cohort)
    for ax, batch in zip(axes[0], batches):
        for row, ratio in ((row, ratio) for row, ratio in found if row["batch"] == batch):
            r, colour = ratio.ratio, colours.get(row[SERIES], OTHER_COLOUR)
            ax.errorbar([row["ctx"]], [r.median], yerr=[[max(r.median - r.low, 0)], [max(r.high - r.median, 0)]],
                        fmt="o", ms=6, capsize=3, color=colour, mfc="none" if ratio.noisy else colour,
                        label=f"{row[SERIES]} (noisy)" if ratio.noisy else str(row[SERIES]))
        ax.axhline(1.0, color="black", lw=0.9)
        _context_axis(ax, timed["ctx"])
        log_scale(ax, "y", as_ratio)
        ax.set_title(f"batch {batch}")
        ax.set_xlabel("context (tokens before the first decode step)")
        ax.grid(True, which="major", alpha=0.3)
    axes[0][0].set_ylabel(f"step time ÷ {reference}'s")
    legend_outside(fig, axes[0], "hollow: a noisy row")
    title(fig, f"Step time against the reference cache's, paired over rounds timed together\n{cohort.title}")
    return save(fig, folder, f"step_ratio_{cohort.slug}.png")


def cache_bytes_vs_tokens(cohort: Cohort, folder: Path) -> Optional[Path]:
    """Cache bytes against batch x tokens, the weights as a line, the crossover marked."""
    per_token, weights, crossover = (cohort.figures[k] for k in ("kv_bytes_per_token", "weight_bytes",
                                                                 "tokens_to_match_weights"))
    cached = positive(cached_rows(cohort.timed), "kv_cache_bytes")  # bytes: noise does not move them
    tokens = (cached["batch"] * (cached["ctx"] + cached["decode_tokens"])).to_numpy(float)
    high = max([crossover * 4, *(tokens * 2)])
    grid = np.geomspace(1, high, 100)
    fig, ax = new_figure(10.0, 4.8)
    ax.plot(grid, grid * per_token, "-", color="#1f77b4", lw=1.8,
            label=f"cache, analytic: {per_token:,} B per token")
    ax.axhline(weights, color="black", lw=1.6, label=f"weights: {weights / 2**20:,.1f} MiB")
    ax.axvline(crossover, color="#d62728", ls=":", lw=1.4)
    ax.annotate(f"cache = weights at\n{crossover:,.0f} tokens", (crossover, weights), xytext=(8, -40),
                textcoords="offset points", color="#d62728", fontsize=9)
    colours = _colours(cohort)
    for strategy in sorted(cached[SERIES].unique()):
        mine = cached[cached[SERIES] == strategy]
        ax.plot(mine["batch"] * (mine["ctx"] + mine["decode_tokens"]), mine["kv_cache_bytes"], "o",
                color=colours.get(strategy, OTHER_COLOUR), ms=6, label=f"{strategy}: allocated, measured")
    log_scale(ax, "x", in_units(""))
    log_scale(ax, "y", in_units("B"))
    ax.set_xlabel("batch × tokens held (ctx + decode_tokens per sequence)")
    ax.set_ylabel("bytes")
    ax.grid(True, which="major", alpha=0.3)
    legend_outside(fig, [ax])
    title(fig, f"KV cache against weights\n{cohort.title}")
    return save(fig, folder, f"cache_bytes_{cohort.slug}.png")


def prefill_vs_decode(cohort: Cohort, folder: Path) -> Optional[Path]:
    """Left: analytic bytes per token of prefill and decode. Right: measured time per token of both, a
    noisy row's hollow and named so (a time per token, set against no roof)."""
    ok = cached_rows(cohort.timed)  # step times usable (cohorts.usable_step)
    ctxs = ok["ctx"] if not ok.empty else cohort.rows["ctx"]
    fig, (left, right) = new_figure(14.0, 4.8, columns=2)
    for i, batch in enumerate(sorted(set(ok["batch"]) or {1})):
        colour = BATCH_COLOURS[i % len(BATCH_COLOURS)]
        grid, prefill = _line(cohort, None, batch, "prefill_bytes_per_token", ctxs)
        decode = _line(cohort, None, batch, "decode_bytes_per_token", ctxs)[1]
        left.plot(grid, decode, "-", color=colour, lw=1.6, label=f"decode, batch {batch}")
        left.plot(grid, prefill, "--", color=colour, lw=1.6, label=f"prefill, batch {batch}")
        for j, strategy in enumerate(ordered_strategies(ok)):  # one marker per cache, one colour per batch
            mine = ok[(ok["batch"] == batch) & (ok[SERIES] == strategy)].sort_values("ctx")
            if mine.empty:
                continue
            marker = MARKERS[j % len(MARKERS)]
            noisy = " (noisy)" if mine["noisy"].any() else ""
            decode_t = mine["decode_step_s"] / mine["batch"]
            right.plot(mine["ctx"], decode_t, marker + ("-" if not noisy else ":"), color=colour, ms=5,
                       mfc="none" if noisy else colour, label=f"decode, {strategy}, batch {batch}{noisy}")
            prefilled = positive(mine, "prefill_s")
            if not prefilled.empty:
                right.plot(prefilled["ctx"], prefilled["prefill_s"] / (prefilled["batch"] * prefilled["ctx"]), marker + "--",
                           color=colour, ms=5, mfc="none", label=f"prefill, {strategy}, batch {batch}{noisy}")
    left.set_title("bytes moved per token (analytic)", fontsize=10)
    left.set_ylabel("bytes per token")
    right.set_title("time per token (measured, cached strategies)", fontsize=10)
    right.set_ylabel("seconds per token")
    for ax, unit in ((left, "B"), (right, "s")):
        _context_axis(ax, ctxs)
        log_scale(ax, "y", in_units(unit))
        ax.set_xlabel("prompt length / context (tokens)")
        ax.grid(True, which="major", alpha=0.3)
        if ax.get_legend_handles_labels()[0]:  # beside its own panel: the two panels' entries differ
            ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    title(fig, f"Prefill against decode, per token\n{cohort.title}")
    return save(fig, folder, f"prefill_vs_decode_{cohort.slug}.png")


def equal_batch_tokens(cohort: Cohort, sets: list, folder: Path) -> Optional[Path]:
    """Workloads with equal batch x ctx side by side: memory (left) and throughput (right)."""
    if not sets:
        return None
    labels, analytic_cache, allocated, peak, measured_tps, roofline_tps = [], [], [], [], [], []
    boundaries = []  # x positions between two sets of equal batch x ctx
    for product, rows in sets:
        if labels:
            boundaries.append(len(labels) - 0.5)
        for _, row in rows.iterrows():
            labels.append(f"{int(row['batch'])}×{int(row['ctx'])}\n(= {product:,})")
            analytic_cache.append(cohort.at(None, row["batch"], row["ctx"], "kv_cache_bytes_at_ctx"))
            allocated.append(row["kv_cache_bytes"])
            peak.append(row.get("peak_memory_bytes"))
            measured_tps.append(row["tokens_per_s"])
            roofline_tps.append(row["predicted_tokens_per_s"])
    x = np.arange(len(labels))
    measured_tps = floats(measured_tps)
    measured_tps[~(np.isfinite(measured_tps) & (measured_tps > 0))] = np.nan  # a log axis draws no 0
    fig, (mem, tps) = new_figure(min(17.0, max(12.0, 1.1 * len(labels) * 2 + 2)), 4.8, columns=2)
    width = 0.27
    mem.bar(x - width, floats(analytic_cache) / 2**20, width, color="#1f77b4", label="cache at batch×ctx (analytic)")
    mem.bar(x, floats(allocated) / 2**20, width, color="#aec7e8", label="cache allocated (measured)")
    mem.bar(x + width, floats(peak) / 2**20, width, color="#c7c7c7", label="peak memory (measured)")
    mem.set_ylabel("MiB")
    mem.set_title("memory: equal at equal batch × ctx", fontsize=10)
    tps.bar(x - width / 2, measured_tps, width, color="#ff7f0e", label="measured")
    tps.bar(x + width / 2, roofline_tps, width, color="#ffbb78", label="roofline")
    log_scale(tps, "y", in_units(""))
    tps.set_ylabel("generated tokens per second")
    tps.set_title("throughput: not equal", fontsize=10)
    for ax in (mem, tps):
        for boundary in boundaries:
            ax.axvline(boundary, color="#bbb", lw=0.8, ls="--")
        ax.set_xticks(x, labels, fontsize=8)
        ax.set_xlabel("batch × ctx")
        ax.grid(True, axis="y", alpha=0.25)
    legend_outside(fig, (mem, tps))
    strategy = sets[0][1][SERIES].iloc[0]
    title(fig, f"Many short sequences against few long ones ({strategy})\n{cohort.title}")
    return save(fig, folder, f"equal_batch_tokens_{cohort.slug}.png")


def peak_memory_split(cohort: Cohort, folder: Path, split_of) -> Optional[Path]:
    """Peak memory of every ok row, stacked: weights, cache, the rest (split_of: summary.memory_split)."""
    points = newest_per_point(cohort.timed, [SERIES, "batch", "ctx"]).sort_values([SERIES, "batch", "ctx"])
    rows = [(r, split) for _, r in points.iterrows() if (split := split_of(r)) is not None]
    if not rows:
        return None
    shown = f" (the first {MAX_BARS} of {len(rows)} points)" if len(rows) > MAX_BARS else ""
    rows = rows[:MAX_BARS]  # a bar per point stays readable up to this many
    labels = [f"{r[SERIES]}\n{int(r['batch'])}×{int(r['ctx'])}" for r, _ in rows]
    weights, cache, rest = (np.array([split[i] for _, split in rows]) / 2**20 for i in (1, 2, 3))
    fig, ax = new_figure(min(18.0, max(10.0, 0.45 * len(rows) + 4)), 4.8)
    x = np.arange(len(rows))
    ax.bar(x, weights, color="#7f7f7f", label="weights")
    ax.bar(x, cache, bottom=weights, color="#1f77b4", label="KV cache (allocated)")
    ax.bar(x, rest, bottom=weights + cache, color="#ff7f0e", label="the rest (activations, slack)")
    ax.set_xticks(x, labels, fontsize=6, rotation=90)
    ax.set_ylabel("MiB at the point's peak")
    ax.grid(True, axis="y", alpha=0.3)
    legend_outside(fig, [ax])
    title(fig, f"Peak memory per point{shown}: weights, cache and the rest\n{cohort.title}")
    return save(fig, folder, f"peak_memory_{cohort.slug}.png")


KIND_STYLES = {  # how a compared point is drawn, by what its verdict means: (marker, colour)
    "worse": ("o", RECOMPUTE_COLOUR), "better": ("o", "#2ca02c"), "unjudged": ("x", "#999999"),
    "same": ("o", STRATEGY_COLOURS[0]),
}


def comparison_ratios(labels: list[str], ratios: list[float], verdicts: list[str], kinds: list[str],
                      quantity: str, path: Path) -> Optional[Path]:
    """This run ÷ the baseline per point (harness.report.compare), on a log axis with a line at 1: one
    legend entry per verdict, drawn by its kind (a KIND_STYLES key)."""
    drawn = [(i, r, v, k) for i, (r, v, k) in enumerate(zip(ratios, verdicts, kinds))
             if np.isfinite(r) and r > 0]  # a log axis has no 0
    if not drawn:
        return None
    fig, ax = new_figure(min(18.0, max(9.0, 0.4 * len(labels) + 4)), 4.8)
    for verdict in dict.fromkeys(v for _, _, v, _ in drawn):
        mine = [(i, r, k) for i, r, v, k in drawn if v == verdict]
        marker, colour = KIND_STYLES[mine[0][2]]
        ax.plot([i for i, _, _ in mine], [r for _, r, _ in mine], marker, color=colour, ms=7, ls="none", label=verdict)
    ax.axhline(1.0, color="black", lw=1.0)
    log_scale(ax, "y", as_ratio)  # 0.5x, not 5×10⁻¹
    ax.set_xticks(range(len(labels)), labels, fontsize=6, rotation=90)
    ax.set_ylabel(f"{quantity}: this run ÷ baseline")
    ax.grid(True, axis="y", which="both", alpha=0.3)
    legend_outside(fig, [ax])
    title(fig, f"This run against the baseline: {quantity} ratio per point")
    return save(fig, path.parent, path.name)

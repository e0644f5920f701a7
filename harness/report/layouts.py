"""The section "which layout wins where": at every point measured with several caches, the caches ranked
by measured step time beside the bytes a step moves and the bytes each allocates against the bytes its
tokens need, and one plot of step time against context per layout.

Everything a layout is comes from the rows' capability and cache_* columns; no strategy is named here.
"""
from __future__ import annotations

from pathlib import Path

import pandas as pd

from harness.report import units as fmt
from harness.report import plots
from harness.report.document import Block, Figure, Heading, Paragraph, Table
from harness.report.cohorts import Cohort, cached_rows, SERIES
from harness.report.verdicts import pooled_step, step_text, verdict

HEADER = ["batch", "ctx", "rank", "strategy", "step measured ±95%", "step ÷ fastest [95%]", "step roofline", "bytes/step (model)",
          "cache allocated", "cache its tokens need", "allocated ÷ needed"]


def ranking_rows(cohort: Cohort) -> list[list[str]]:
    """One line per cache at every (batch, ctx) of the cohort where two or more caches ran, ranked by
    pooled median step; each against the fastest with the paired interval (a tie where it holds 1)."""
    body = []
    cached = cached_rows(cohort.timed).dropna(subset=["decode_step_s"])  # a noisy row's ratio is kept, marked
    for (batch, ctx), rows in cached.groupby(["batch", "ctx"], sort=True):
        if rows[SERIES].nunique() < 2:
            continue
        judged = verdict(rows)
        ranked = [judged.fastest] + sorted(judged.comparisons, key=lambda name: judged.comparisons[name].ratio.median)
        for rank, series in enumerate(ranked, start=1):
            mine = rows[rows[SERIES] == series]
            r, step = mine.iloc[0], pooled_step(mine)
            needed = r["kv_cache_used_bytes_model"]
            allocated = r["kv_cache_bytes"]
            against = judged.comparisons[series].text() if series in judged.comparisons else "fastest"
            body.append([fmt.count(batch), fmt.count(ctx), str(rank), str(series),
                         step_text(step) + (" (noisy)" if bool(mine["noisy"].any()) else ""),
                         against, fmt.seconds(r.get("predicted_step_s")),
                         fmt.nbytes(r["bytes_per_step_model"]), fmt.nbytes(allocated), fmt.nbytes(needed),
                         fmt.ratio(allocated / needed) if needed and not pd.isna(allocated) else "–"])
    return body


def layout_section(cohorts: list[Cohort], folder: Path) -> list[Block]:
    out: list[Block] = [Heading("Which layout wins where"), Paragraph(
        "Per point, the caches ranked by measured step time (pooled over repeats), each against the fastest "
        "with the 95% interval of the ratio over rounds timed together; a ratio whose interval holds 1 is a tie. "
        "Bytes per step are the model's for each layout "
        "(weights, the cache read, written and, for a cache grown by concatenation, copied; a table read "
        "over its whole max_len counts every position). Cache allocated is what the run held at its end; "
        "what its tokens need is batch × tokens at the layout's stored width: the ratio is a paged cache's "
        "fragmentation (whole blocks), a static table's unfilled positions, a residual window's full width.")]
    shown = False
    for cohort in cohorts:
        body = ranking_rows(cohort)
        if not body:
            continue
        shown = True
        out.append(Heading(cohort.title, 3))
        out.append(Table(HEADER, body, [True, True, True, False] + [True] * 7))
        path = plots.step_time_vs_context(cohort, folder, cached_only=True)
        if path is not None:
            out.append(Figure(path, "Step time against context per layout: dots measured (bars: 95% interval), lines the "
                                    "roofline of each layout's bytes and FLOPs."))
    if not shown:
        out.append(Paragraph("No point here ran two caches: sweep several, e.g. "
                             "`python -m harness.run -m strategy=contiguous,paged,dynamic,static_full prefill=random`."))
    return out

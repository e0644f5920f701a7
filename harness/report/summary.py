"""The report's first screen: one line per measured point of this machine, what it answers at a glance.

Per model x device x dtype x linear kernel x batch x ctx: the verdict among the caches there (the fastest
where its interval clears the next one's, else the caches tied within the intervals: harness.report.verdicts),
what the plain cache saved against the recompute reference in time (with its interval, compared as the
verdict is) and in FLOPs (the gap between the two is the report's main story), the roof that binds the
fastest step and the share of it reached, tokens per second, and the peak memory of the plain cache's
run split into weights, cache and the rest (activations, the allocator's slack, the runtime's buffers).
Rows flagged noisy stay in: their ratios to the members timed in the same rounds hold (marked `noisy`,
wider), and their memory does not depend on the machine's load; only the share of the roof reached, an
absolute time set against a roof, reads `– (noisy)`.
"""
from __future__ import annotations

import pandas as pd

from harness.analysis.results import SERIES
from harness.report import units as fmt
from harness.report.document import Table
from harness.report.cohorts import Cohort, cached_rows, recompute_rows
from harness.report.verdicts import Verdict, compare, pooled_step, step_text, verdict

HEADER = ["model", "device", "dtype", "linears", "batch", "ctx", "verdict", "fastest step", "tokens/s", "bound", "of its roof",
          "cache saves: time", "cache saves: FLOPs", "peak memory", "peak: weights", "peak: cache", "peak: rest"]


def _one(rows: pd.DataFrame, series: str | None):
    mine = rows[rows[SERIES] == series] if series is not None else rows.iloc[0:0]
    return mine.iloc[0] if not mine.empty else None


def memory_split(row) -> tuple[float, float, float, float] | None:
    """(peak, weights, cache, the rest) of a row's peak memory, or None where no peak was measured."""
    if row is None or fmt.missing(row.get("peak_memory_bytes")):
        return None
    peak, weights = float(row["peak_memory_bytes"]), float(row["weight_bytes"])
    cache = 0.0 if fmt.missing(row.get("kv_cache_bytes")) else float(row["kv_cache_bytes"])
    return peak, weights, cache, max(peak - weights - cache, 0.0)


def summary_rows(cohort: Cohort, verdicts: list[Verdict] | None = None) -> list[list[str]]:
    """One line per (batch, ctx) of the cohort; each point's Verdict is appended to `verdicts` when given."""
    body = []
    ok = cohort.timed.dropna(subset=["decode_step_s"])
    plain = cohort.plain_cache()
    for (batch, ctx), rows in ok.groupby(["batch", "ctx"], sort=True):
        caches = cached_rows(rows)  # the recompute reference has its own column: what the cache saves
        judged = verdict(caches if not caches.empty else rows)
        if verdicts is not None:
            verdicts.append(judged)
        fastest = rows[rows[SERIES] == judged.fastest].iloc[0]
        cached, recompute = _one(rows, plain), recompute_rows(rows)
        time_saved = flops_saved = "–"
        if cached is not None and not recompute.empty:
            time_saved = compare(recompute, rows[rows[SERIES] == plain]).text()
            flops_saved = fmt.ratio(cohort.at(recompute[SERIES].iloc[0], batch, ctx, "flops_per_step_model")
                                    / cohort.at(plain, batch, ctx, "flops_per_step_model"))
        split = memory_split(cached if cached is not None else fastest)
        memory = [fmt.nbytes(v) for v in split] if split else ["–"] * 4
        fraction, in_rounds = fastest.get("roofline_fraction"), fastest.get("roofline_fraction_in_rounds")
        of_roof = "–" if fmt.missing(fraction) else f"{fraction:.0%}"
        if bool(fastest.get("noisy")):  # a busy machine's time against a quiet machine's roof says nothing
            of_roof = "– (noisy)"
        elif not fmt.missing(fraction) and not fmt.missing(in_rounds) and abs(in_rounds / fraction - 1) > 0.25:
            of_roof += f" of the calibrated roof ({in_rounds:.0%} of the read in its own rounds)"  # which was judged
        linears = fastest.get("matmul") if isinstance(fastest.get("matmul"), str) else "–"  # the cohort's kernel
        step = pooled_step(rows[rows[SERIES] == judged.fastest])
        noisy = " (noisy)" if bool(rows.loc[rows[SERIES] == judged.fastest, "noisy"].any()) else ""
        body.append([cohort.model, cohort.device, cohort.dtype, linears, fmt.count(batch), fmt.count(ctx), judged.text,
                     step_text(step) + noisy,
                     fmt.number(int(batch) / step.median),
                     str(fastest.get("roof_bound") or "–"), of_roof,
                     time_saved, flops_saved, *memory])
    return body


def summary_table(cohorts: list[Cohort], verdicts: list[Verdict] | None = None) -> Table:
    """The first screen's table; each point's Verdict is appended to `verdicts` when given."""
    body = [line for cohort in cohorts for line in summary_rows(cohort, verdicts)]
    return Table(HEADER, body, [False, False, False, False, True, True, False] + [True] * 10)

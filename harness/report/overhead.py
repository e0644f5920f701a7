"""Two sections on the time a step spends beyond its roofline: "what the roofline does not explain"
(per cached point, the share of the measured step above the roofline time) and "eager against
compiled" (the same point measured with compile=none and compile=inductor, side by side).

Strategies are told apart by the rows' `series` and capability columns only; no name is compared here.
"""
from __future__ import annotations

from pathlib import Path

import pandas as pd

from harness.analysis.results import SERIES
from harness.report import units as fmt
from harness.report.document import Block, Heading, Paragraph, Table
from harness.report.cohorts import Cohort, cached_rows, newest_per_point

GEMV_TOLERANCE = 0.05  # a matrix-vector read within this of the roof counts as having set it
EAGER, COMPILED = "none", "inductor"  # the values of the `compile` column (harness.config.validate)
POINT = [SERIES, "batch", "ctx", "decode_tokens"]  # a point's identity within a cohort, compile mode aside

UNEXPLAINED_HEADER = ["series", "compile", "batch", "ctx", "step measured", "step roofline", "unexplained share",
                      "unexplained time"]
PAIR_HEADER = ["series", "batch", "ctx", "decode steps", "eager step", "compiled step", "speedup", "compile_s",
               "recompiles"]

# What the gap usually is on a CPU, stated without numbers: the report measures only its size.
CPU_CAUSES = ("On a CPU it is usually per-operator dispatch, the Python between operators, small GEMVs "
              "whose weight matrices are too small to reach the stream bandwidth the roof was calibrated with, "
              "and, on a machine that shares its memory bandwidth (a VM), a roof that is the best read of the "
              "calibration while each step is a median: the bandwidth such a machine gives moves by tens of "
              "percent within minutes. The table measures the size of the gap, not which of these it is.")
GPU_CAUSES = ("On a GPU it is usually kernel launches and the host's Python between small kernels; the table "
              "measures the size of the gap, not which of these it is.")


def compile_mode(rows: pd.DataFrame) -> pd.Series:
    """Each row's compile mode (a row that did not run records none: eager)."""
    return rows["compile"].fillna(EAGER).astype(str)


def unexplained(rows: pd.DataFrame) -> pd.DataFrame:
    """Cached rows with a measured and a roofline step, `share` = 1 - roofline / measured clipped at 0
    (a row below its roof, beyond rounding, is noise, not negative overhead: `faster` flags it) and
    `gap_s`, the time above the roof in seconds."""
    found = cached_rows(rows).dropna(subset=["decode_step_s", "predicted_step_s"])
    found = found[found["decode_step_s"] > 0]
    raw = 1.0 - found["predicted_step_s"] / found["decode_step_s"]
    return found.assign(compile=compile_mode(found), share=raw.clip(lower=0.0), faster=raw < -1e-9,
                        gap_s=(found["decode_step_s"] - found["predicted_step_s"]).clip(lower=0.0))


def _gemv_sentence(found: pd.DataFrame) -> str:
    """What the calibration's matrix-vector products read beside the roof, where the rows recorded both:
    a step is made of such products, so a roof set by a faster stream is a share no step can close."""
    if "roof_bandwidth_gemv_Bps" not in found:
        return ""
    both = found.dropna(subset=["roof_bandwidth_Bps", "roof_bandwidth_gemv_Bps"])
    if both.empty:
        return ""
    roof, gemv = both["roof_bandwidth_Bps"].median(), both["roof_bandwidth_gemv_Bps"].median()
    if gemv >= roof * (1 - GEMV_TOLERANCE):
        return f" The roof ({fmt.rate(roof, 'B/s')}) is the calibration's matrix-vector read, the kind of read a step makes."
    return (f" The roof ({fmt.rate(roof, 'B/s')}) is the calibration's fastest read, a stream; its best matrix-vector "
            f"product, the kind of read a step makes, reached {fmt.rate(gemv, 'B/s')}: a step reading its bytes at that "
            f"rate would already leave {1 - gemv / roof:.0%} of its time unexplained.")


def _unexplained_section(cohorts: list[Cohort]) -> list[Block]:
    out: list[Block] = [Heading("What the roofline does not explain"), Paragraph(
        "Per cached point: the measured step, the roofline time (max of FLOPs ÷ peak and bytes ÷ bandwidth) "
        "and the share of the step the roofline does not account for, 1 − roofline ÷ measured, with that "
        "time in ms. Noisy rows are left out.")]
    shown = False
    for cohort in cohorts:
        found = unexplained(cohort.ok).sort_values([SERIES, "compile", "batch", "ctx"])
        if found.empty:
            continue
        shown = True
        body = [[str(r[SERIES]), str(r["compile"]), fmt.count(r["batch"]), fmt.count(r["ctx"]),
                 fmt.seconds(r["decode_step_s"]), fmt.seconds(r["predicted_step_s"]),
                 f"{r['share']:.0%}" + (" (faster than its roof: noisy)" if r["faster"] else ""),
                 f"{r['gap_s'] * 1e3:.3g} ms"] for _, r in found.iterrows()]
        out += [Heading(cohort.title, 3), Table(UNEXPLAINED_HEADER, body, [False, False] + [True] * 6)]
        sentence = (f"Median unexplained share: {found['share'].median():.0%} of the step, over {len(found)} "
                    f"point(s). {CPU_CAUSES if cohort.device == 'cpu' else GPU_CAUSES}{_gemv_sentence(found)}")
        faster = int(found["faster"].sum())
        if faster:
            sentence += (f" {faster} row(s) ran faster than the roofline allows: their share is shown as 0, and "
                         "their numbers are noise (a roof calibrated on a busy machine; re-run with `calibrate=true`).")
        out.append(Paragraph(sentence))
    if not shown:
        out.append(Paragraph("No cached strategy has an ok row with a roofline prediction here."))
    return out


def _newest(rows: pd.DataFrame) -> pd.DataFrame:
    """One row per point, indexed by it: the newest where a point was measured more than once."""
    return newest_per_point(rows, POINT).set_index(POINT)


def pairs(cohort: Cohort) -> pd.DataFrame:
    """The cohort's points measured both eager and compiled: eager_s, compiled_s, speedup, compile_s,
    recompiles per point. A mode measured without its partner is left out."""
    rows = cohort.ok.dropna(subset=["decode_step_s"])
    rows = rows.assign(compile=compile_mode(rows))
    eager = _newest(rows[rows["compile"] == EAGER])
    compiled = _newest(rows[rows["compile"] == COMPILED])
    both = eager.index.intersection(compiled.index)
    if both.empty:
        return pd.DataFrame(columns=["eager_s", "compiled_s", "speedup", "compile_s", "recompiles"])
    eager, compiled = eager.loc[both], compiled.loc[both]
    found = pd.DataFrame({"eager_s": eager["decode_step_s"], "compiled_s": compiled["decode_step_s"],
                          "compile_s": compiled.get("compile_s", pd.Series(None, index=both)),
                          "recompiles": compiled.get("compile_recompiles", pd.Series(None, index=both))}, index=both)
    return found.assign(speedup=found["eager_s"] / found["compiled_s"]).sort_index()


def _compiled_section(cohorts: list[Cohort]) -> list[Block]:
    out: list[Block] = [Heading("Eager against compiled"), Paragraph(
        "Points measured with both `compile=none` and `compile=inductor` (same series, batch, ctx and decode "
        "steps): the eager and the compiled step, the speedup (eager ÷ compiled), the seconds spent compiling "
        "before timing, and the graphs recompiled during the timed steps. Points measured in one mode only "
        "are not shown.")]
    shown = False
    for cohort in cohorts:
        found = pairs(cohort)
        if found.empty:
            continue
        shown = True
        body = [[str(series), fmt.count(batch), fmt.count(ctx), fmt.count(steps), fmt.seconds(p["eager_s"]),
                 fmt.seconds(p["compiled_s"]), fmt.ratio(p["speedup"]), fmt.number(p["compile_s"]),
                 fmt.count(p["recompiles"])] for (series, batch, ctx, steps), p in found.iterrows()]
        out += [Heading(cohort.title, 3), Table(PAIR_HEADER, body, [False] + [True] * 8),
                Paragraph(f"Median speedup: {fmt.ratio(found['speedup'].median())} over {len(found)} point(s).")]
    if not shown:
        first = cohorts[0] if cohorts else None  # none: the run's defaults stand for the model and device
        cached = first.plain_cache_strategy_name() if first else None  # none: the run's default strategy
        where = f"{first.model_key} " if first else ""
        keys = f"{where}{f'strategy={cached} ' if cached else ''}compile={EAGER},{COMPILED} batch=1,4 ctx=256,1024"
        out.append(Paragraph(
            "No point here ran both eager and compiled; a sweep that does: "
            f"`python -m harness.run -m {keys}{f' device={first.device}' if first else ''}`."))
    return out


def overhead_section(cohorts: list[Cohort], folder: Path) -> list[Block]:
    """Both sections; `folder` (where plots go) is taken like the other sections' though none is drawn."""
    return _unexplained_section(cohorts) + _compiled_section(cohorts)

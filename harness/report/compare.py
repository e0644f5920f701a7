"""Two runs compared: this results folder against a baseline folder, point by point.

A point is in both runs when an ok row of each has the same IDENTITY: the decoder shape, the strategy
with its options, the backend, batch, ctx, decode steps and dtype. The device is not part of it, so a
CPU folder can be compared with a GPU folder; the measurement conditions (linear-layer kernel, threads,
timing options, host) are not either: they are what a comparison of two runs is there to show.

Per matched point: both step times and their ratio, both roof fractions and theirs, and a verdict from
both rows' spreads. Rows marked noisy in either run get no verdict (they are counted and named). When
the two rows ran on different devices (device_name differs) a time ratio measures the machines, so the
verdict and the section's lead are the roof fraction, the share of each machine's own roof reached.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from harness.analysis.results import SERIES
from harness.config.validate import ConfigError, input_folder
from harness.report import units as fmt
from harness.report import plots
from harness.report.document import Block, Bullets, Figure, Heading, Paragraph, Table
from harness.report.cohorts import newest_per_point
from harness.report.tables import ROW_ORDER, skipped_files_table

# What makes two rows the same point. decode_tokens is in it because a row's step is the mean over
# contexts ctx .. ctx + decode_tokens - 1; rope_theta and norm_eps are not (they change no step's cost).
IDENTITY = ("model", "vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "head_dim",
            "strategy", "strategy_options", "backend", "batch", "ctx", "decode_tokens", "dtype")
# Kept per side for the table and the verdicts (a side's copy is suffixed _baseline after the merge).
SIDE = ("decode_step_s", "decode_step_p10_s", "decode_step_p90_s", "roof_fraction", "noisy", "noise_reason",
        "device_name")
SLOWER, FASTER, WITHIN, NOISY, UNJUDGED = "slower beyond noise", "faster beyond noise", "within noise", "noisy", "–"
KINDS = {SLOWER: "worse", FASTER: "better", NOISY: "unjudged"}  # how the plot draws a verdict (plots.KIND_STYLES)
PLOT_NAME = "compare_baseline.png"


def baseline_folder(value) -> Path:
    """The baseline folder, checked as results_dir is (harness.config.validate.input_folder), and
    listed once: an unreadable folder is refused here, before anything is written, not later as a
    fault while writing the report."""
    path = input_folder("baseline", value)
    try:
        os.listdir(path)
    except OSError as error:
        raise ConfigError("baseline", f"cannot read '{path}': {error.strerror or error}") from None
    return path


def roof_fractions(table: pd.DataFrame) -> pd.Series:
    """Each row's share of its roof: the runner's roofline_fraction (at the roofs recorded in the row),
    else predicted ÷ measured step at the roof results.load found (rows written without roofs)."""
    recorded = pd.to_numeric(table["roofline_fraction"], errors="coerce")
    predicted = 1 / pd.to_numeric(table["ratio_decode_step_s"], errors="coerce")
    return recorded.where(recorded.notna(), predicted)


def _identity(table: pd.DataFrame) -> pd.Series:
    """One text key per row; a null counts as empty in both runs."""
    parts = [table[c].astype(object).where(table[c].notna(), "").astype(str) for c in IDENTITY]
    return pd.concat(parts, axis=1).agg("|".join, axis=1) if len(table) else pd.Series([], dtype=str)


def _ok_points(table: pd.DataFrame) -> pd.DataFrame:
    """The ok rows with a step time, one per point: the newest where a folder holds re-runs of one."""
    if table.empty or "decode_step_s" not in table:
        return pd.DataFrame(columns=["identity", *ROW_ORDER, "backend", *SIDE])
    ok = table[(table["status"] == "ok") & table["decode_step_s"].notna()].copy()
    ok["identity"] = _identity(ok)
    ok["roof_fraction"] = roof_fractions(ok)
    ok["noisy"] = ok["noisy"].fillna(False).astype(bool)
    return newest_per_point(ok, "identity")[["identity", *ROW_ORDER, "backend", *SIDE]]


def _verdict(point) -> str:
    """Slower beyond noise when the two spreads do not overlap: this run's p10 step above the baseline's
    p90. Across devices the same rule on roof fractions, each spread being roofline time ÷ [p90, p10]
    (the time rule with each step measured against its own machine's roof)."""
    if point["noisy"] or point["noisy_baseline"]:
        return NOISY
    if point["device_name"] == point["device_name_baseline"]:
        ends = [point[c] for c in ("decode_step_p10_s", "decode_step_p90_s",
                                   "decode_step_p10_s_baseline", "decode_step_p90_s_baseline")]
    else:  # a larger fraction is a faster step: the ends are swapped and negated to keep one rule
        ends = [-_fraction_at(point, "decode_step_p10_s", ""), -_fraction_at(point, "decode_step_p90_s", ""),
                -_fraction_at(point, "decode_step_p10_s", "_baseline"),
                -_fraction_at(point, "decode_step_p90_s", "_baseline")]
    if any(fmt.missing(end) for end in ends):
        return UNJUDGED
    low, high, base_low, base_high = ends
    return SLOWER if low > base_high else FASTER if high < base_low else WITHIN


def _fraction_at(point, step_column: str, side: str) -> float:
    """The roof fraction the row would show at one end of its step spread (fraction ∝ 1 / step)."""
    return point[f"roof_fraction{side}"] * point[f"decode_step_s{side}"] / point[f"{step_column}{side}"]


@dataclass
class Comparison:
    """The two runs matched: one row per point in both, and what matched nothing."""

    points: pd.DataFrame  # ROW_ORDER, backend, each SIDE column twice (_baseline), step_ratio, fraction_ratio, verdict
    only_baseline: int  # ok points of the baseline with no ok row here
    only_baseline_not_ok_here: int  # of those, points this run has a skipped or failed row of
    only_here: int  # ok points of this run that the baseline lacks
    across_devices: bool  # some matched point ran on different devices in the two runs


def compare(table: pd.DataFrame, baseline: pd.DataFrame) -> Comparison:
    """Match this run's ok points with the baseline's (IDENTITY) and judge each (see _verdict)."""
    here, base = _ok_points(table), _ok_points(baseline)
    points = here.merge(base[["identity", *SIDE]], on="identity", suffixes=("", "_baseline"))
    points["step_ratio"] = points["decode_step_s"] / points["decode_step_s_baseline"]
    points["fraction_ratio"] = points["roof_fraction"] / points["roof_fraction_baseline"]
    points["verdict"] = [_verdict(p) for _, p in points.iterrows()] if len(points) else []
    missing = base[~base["identity"].isin(here["identity"])]
    tried_here = set(_identity(table)) if len(table) and "status" in table else set()
    return Comparison(
        points=points.sort_values(ROW_ORDER).reset_index(drop=True),
        only_baseline=len(missing), only_baseline_not_ok_here=int(missing["identity"].isin(tried_here).sum()),
        only_here=int((~here["identity"].isin(base["identity"])).sum()),
        across_devices=bool((points["device_name"] != points["device_name_baseline"]).any()),
    )


def _share(value) -> str:
    """A roof fraction as a percentage to 3 figures: the tiny model reaches well under 1% of a roof."""
    return "–" if fmt.missing(value) else f"{float(value) * 100:.3g}%"


def _label(point) -> str:
    return (f"{point[SERIES]} ({point['backend']}) · {point['model']} · {point['dtype']} · "
            f"b={point['batch']} ctx={point['ctx']}")


def _change(point, fractions_first: bool) -> str:
    """One slower point in words, the lead figure first."""
    step = (f"step {fmt.seconds(point['decode_step_s_baseline'])} → {fmt.seconds(point['decode_step_s'])} "
            f"({fmt.ratio(point['step_ratio'])})")
    fraction = (f"roof fraction {_share(point['roof_fraction_baseline'])} → {_share(point['roof_fraction'])} "
                f"({fmt.ratio(point['fraction_ratio'])})")
    return f"{_label(point)}: " + (f"{fraction}, {step}" if fractions_first else f"{step}, {fraction}")


def _table(points: pd.DataFrame, fractions_first: bool) -> Table:
    steps = [("baseline step", lambda p: fmt.seconds(p["decode_step_s_baseline"])),
             ("this step", lambda p: fmt.seconds(p["decode_step_s"])),
             ("step ratio", lambda p: fmt.ratio(p["step_ratio"]))]
    fractions = [("baseline of its roof", lambda p: _share(p["roof_fraction_baseline"])),
                 ("this of its roof", lambda p: _share(p["roof_fraction"])),
                 ("roof fraction ratio", lambda p: fmt.ratio(p["fraction_ratio"]))]
    figures = fractions + steps if fractions_first else steps + fractions
    header = ["strategy", "backend", "model", "dtype", "batch", "ctx", *(name for name, _ in figures), "verdict"]
    body = [[str(p[SERIES]), str(p["backend"]), str(p["model"]), str(p["dtype"]), fmt.count(p["batch"]),
             fmt.count(p["ctx"]), *(cell(p) for _, cell in figures), p["verdict"]] for _, p in points.iterrows()]
    return Table(header, body, [False] * 4 + [True] * 8 + [False])


def _counts(result: Comparison, baseline_dir) -> str:
    not_ok = (f" ({result.only_baseline_not_ok_here} of them skipped or failed here)"
              if result.only_baseline_not_ok_here else "")
    return (f"Baseline `{baseline_dir}`: {len(result.points)} point(s) in both runs; "
            f"{result.only_baseline} point(s) only in the baseline{not_ok}, {result.only_here} only in this run. "
            "A point is the same when its model shape, strategy and options, backend, batch, ctx, decode "
            "steps and dtype are; only ok rows are matched, the newest where a folder re-ran a point.")


def _devices(points: pd.DataFrame, column: str) -> str:
    return ", ".join(sorted({str(d) for d in points[column]})) or "–"


def comparison_section(table: pd.DataFrame, baseline: pd.DataFrame, folder: Path) -> list[Block]:
    """The report's section on this run against the baseline: counts, the rule, the slower points, the
    noisy ones named, every matched point in a table, and one plot of the ratios."""
    result = compare(table, baseline)
    out: list[Block] = [Heading("Against the baseline"), Paragraph(_counts(result, baseline.attrs.get("results_dir")))]
    unread = baseline.attrs.get("skipped_files", [])
    if unread:  # the baseline's own files that are not rows: its points compared here are fewer
        out += [Paragraph(f"{len(unread)} file(s) of the baseline folder are not rows and were not read:"),
                skipped_files_table(unread)]
    points = result.points
    if points.empty:
        return out + [Paragraph("**No point is in both runs**: nothing to compare. The two folders share no "
                                "ok row of the same point (compare a sweep with a re-run of the same command).")]
    lead = "roof fraction" if result.across_devices else "step time"
    if result.across_devices:
        out.append(Paragraph(
            f"**Different devices** (this run: {_devices(points, 'device_name')}; baseline: "
            f"{_devices(points, 'device_name_baseline')}): a step-time ratio here measures the two machines, "
            "not the code. The fair comparison is the share of each machine's own roof a step reaches, so "
            "the table leads with roof fractions and the verdicts of those points use them."))
    out.append(Paragraph(
        "**Two runs are measured apart.** On a shared machine the bandwidth a step gets moves by tens of "
        "percent within minutes, so a step-time ratio between two runs holds the machine's drift as well as "
        "any change of the code: only a difference beyond both spreads is called one, and a difference of a "
        "few percent between runs is not resolved. To compare strategies, time them in one run "
        "(interleave=shape, the default)."))
    out.append(Paragraph(
        "**Slower beyond noise**: this run's p10 step is above the baseline's p90 step, so the two spreads "
        "of step times do not overlap (faster beyond noise: this run's p90 below the baseline's p10). Across "
        "devices the same rule on roof fractions: this run's best fraction (at its p10 step) below the "
        "baseline's worst (at its p90). Ratios are this run ÷ the baseline: a step ratio above 1 and a "
        "roof fraction ratio below 1 are slower."))
    slower = points[points["verdict"] == SLOWER]
    out.append(Heading(f"Slower beyond noise: {len(slower)} of {len(points)} point(s)", 3))
    out.append(Bullets([_change(p, result.across_devices) for _, p in slower.iterrows()])
               if len(slower) else Paragraph("None: no point got slower by more than its spread."))
    noisy = points[points["verdict"] == NOISY]
    if len(noisy):
        out.append(Paragraph(f"**{len(noisy)} point(s) noisy** in one run or both: shown, but no verdict."))
        sides = (("this run", ""), ("baseline", "_baseline"))
        out.append(Bullets([f"{_label(p)}: " + "; ".join(f"{side}: {p['noise_reason' + suffix] or 'noisy'}"
                                                         for side, suffix in sides if p["noisy" + suffix])
                            for _, p in noisy.iterrows()]))
    out.append(_table(points, result.across_devices))
    ratio = "fraction_ratio" if result.across_devices else "step_ratio"
    verdicts = points["verdict"].tolist()
    path = plots.comparison_ratios([_label(p) for _, p in points.iterrows()], points[ratio].tolist(), verdicts,
                                   [KINDS.get(v, "same") for v in verdicts], lead, folder / PLOT_NAME)
    if path is None:
        return out + [Paragraph(f"*(plot omitted: no point has a {lead} ratio)*")]
    worse = "above" if not result.across_devices else "below"
    return out + [Figure(path, f"This run ÷ the baseline, {lead} per point (log scale). The line is no change; "
                               f"{worse} it is slower. Red: slower beyond noise; green: faster beyond noise; "
                               "grey crosses: noisy in one run, no verdict.")]

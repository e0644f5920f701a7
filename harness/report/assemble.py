"""Assemble the report: load the rows, draw each cohort's plots, tabulate, answer, write both files."""
from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from harness.config.validate import ConfigError, input_folder, output_folder
from harness.files import write_whole
from harness.report import apart, compare, guard, plots, tables
from harness.report import units as fmt
from harness.report.document import Block, Figure, Heading, Paragraph, Table, to_markdown
from harness.report.cohorts import SERIES, Cohort, cohorts_of, noisy_flags
from harness.report.compression import HEADING as COMPRESSION_HEADING
from harness.report.compression import compressed, compression_section
from harness.report.engines import engine_section
from harness.report.kv_formats import format_section
from harness.report.html import to_html
from harness.report.layouts import layout_section
from harness.report.outputs import Outputs, claim, refuse_results_folder
from harness.report.overhead import overhead_section
from harness.report.summary import memory_split, summary_table
from harness.report.tradeoff import ran_rows
from harness.report.unread import UNREAD_COLUMNS
from harness.report.verdicts import resolution_paragraph
from harness.report.questions import answers
from harness.report.serving import is_serving, serving_section
from harness.analysis.results import DEFAULT_FALLBACK_HARDWARE, Results, read_results

REPORT_DIR = "_report"  # under results_dir: '_' so pandas.read_parquet(results_dir) skips it
TITLE = "Decode strategies: measured against the analytic model"
MAX_PLOTTED_COHORTS = 12  # cohorts given their own plots; a folder of more lists the rest by name


class ReportError(ValueError):
    """Bad input to the report; the message is the one line printed."""


@dataclass
class ReportFiles:
    """What a report run wrote."""

    markdown: Path  # report.md, images referenced by relative path
    html: Path  # index.html, images embedded: one file to send around
    csv: Path  # rows.csv: the full table of rows that ran
    figures: list[Path] = field(default_factory=list)  # the PNGs next to them


def _status_counts(table: pd.DataFrame) -> str:
    counts = table["status"].value_counts() if "status" in table else {}
    return ", ".join(f"{counts.get(s, 0)} {s}" for s in ("ok", "skipped", "failed"))


def _cohort_section(cohort: Cohort, folder: Path, sets: list) -> list[Block]:
    """The plots of one model/device/dtype, each with a caption saying what to look at; a plot the rows
    cannot show, or one that fails, leaves a line saying why."""
    out: list[Block] = [Heading(f"Measured against predicted: {cohort.title}"),
                        Paragraph(f"Roof: {cohort.roof_description}.")]
    if not cohort.unusable.empty:
        out.append(Paragraph(unusable_note(cohort)))
    figures = [
        (lambda: plots.step_time_vs_context(cohort, folder),
         "Decode step time against context. Dots: measured medians (bars: their 95% interval over rounds); lines: the roofline "
         "prediction per strategy. The gap between a dot and its line is what the roofline does not model.",
         "every row here is noisy: their times are not set against the roofline (their paired ratios are, below)"
         if cohort.ok.empty and not cohort.timed.empty else "No ok row with a decode time."),
        (lambda: plots.step_ratio_vs_context(cohort, folder),
         "Each strategy's step time ÷ the reference cache's, paired over the rounds they were timed together in (bars: "
         "95% interval). Hollow: a ratio drawing on a noisy row, kept because the members of a round share the load, "
         "its interval wider.", "Needs a reference cache and another strategy timed at the same point."),
        (lambda: plots.no_cache_over_cache(cohort, folder),
         "No cache ÷ cache per decode step. Black: FLOP ratio; dashed: predicted (roofline) time ratio; "
         "dots: measured time ratio. The distance between the black line and the dots is the FLOP saving "
         "that does not turn into wall-clock saving.",
         "Needs `no_cache` and a cached strategy at the same batch and context."),
        (lambda: plots.cache_bytes_vs_tokens(cohort, folder),
         "Cache bytes against batch × tokens: only the product matters. The weights are the flat line; the "
         "red mark is where the cache outweighs them.", ""),
        (lambda: plots.prefill_vs_decode(cohort, folder),
         "Prefill reads the weights once for the whole prompt; decode reads them (and the cache) for every "
         "token. Left: bytes per token (analytic); right: measured time per token (hollow, dotted: a noisy row).", ""),
        (lambda: plots.peak_memory_split(cohort, folder, memory_split),
         "Each point's peak memory: the weights, the cache it allocated, and the rest (activations, the "
         "allocator's slack, runtime buffers).", "No row measured a peak."),
    ]
    for draw, caption, missing in figures:
        path, failed = guard.plot(draw)
        if path is not None:
            out.append(Figure(path, caption))
        elif failed or missing:
            out.append(Paragraph(failed or f"*(plot omitted: {missing})*"))
    out.append(Heading("Equal batch × tokens: memory and throughput", 3))
    if sets:
        out.append(tables.equal_product_table(sets))
        path, failed = guard.plot(lambda: plots.equal_batch_tokens(cohort, sets, folder))
        out.append(Figure(path, "Same batch × ctx: the cache is the same to the byte (left, dark bars), throughput is "
                                "not (right).") if path is not None else Paragraph(failed))
    else:
        batches = sorted(cohort.ok["batch"].unique()) or [1]
        b = int(batches[0])
        name = cohort.plain_cache_strategy_name()  # none: the run's default strategy, a cache
        strategy = f"strategy={name} " if name else ""
        out.append(Paragraph(
            "No two rows of one cached strategy share batch × ctx here. A sweep with such pairs: "
            f"`python -m harness.run -m {cohort.model_key} {strategy}"
            f"batch={b},{4 * b} ctx=256,1024 device={cohort.device} dtype={cohort.dtype}` "
            f"({b} × 1024 = {4 * b} × 256)."))
    return out


def unusable_note(cohort: Cohort) -> str:
    """The line naming a cohort's rows that ran but recorded no usable step time."""
    named = ", ".join(f"`{r[SERIES]}` b={int(r['batch'])} ctx={int(r['ctx'])} ({fmt.number(r['decode_step_s'])})"
                      for _, r in cohort.unusable.head(6).iterrows())
    more = f" and {len(cohort.unusable) - 6} more" if len(cohort.unusable) > 6 else ""
    return (f"**{len(cohort.unusable)} row(s) with status ok recorded no usable decode step time** (null, 0, negative "
            f"or infinite: {named}{more}); they are left out of every plot and ratio, and listed in the rows table.")


def _not_measured(table: pd.DataFrame) -> list[Block]:
    out: list[Block] = [Heading("Rows and files not measured")]
    bad = table[table["status"] != "ok"] if "status" in table else table.iloc[0:0]
    out.append(tables.not_measured_table(table) if not bad.empty else Paragraph("Every row ran (status ok)."))
    unpredicted = table[table["roof_source"] == "none"] if "roof_source" in table else table.iloc[0:0]
    if not unpredicted.empty:
        out += [Paragraph(f"**{len(unpredicted)} row(s) could not be predicted**, so they are in no group, plot or "
                          "ratio:"), tables.unpredicted_table(unpredicted)]
    skipped = table.attrs.get("skipped_files", [])
    out.append(Heading("Files in the results folder that are not rows", 3))
    out.append(tables.skipped_files_table(skipped) if skipped else Paragraph("None: every file was a readable row."))
    duplicates = table.attrs.get("duplicates", [])
    if duplicates:  # a copied file, or a folder named twice: each row counts once
        out += [Heading("Rows read more than once, counted once", 3), Table(
            ["point_key", "read from"], [[key, ", ".join(f"`{f}`" for f in files)] for key, files in duplicates])]
    problems = table.attrs.get("calibration_problems", [])
    if problems:
        out += [Heading("Calibration files that could not be read", 3), tables.skipped_files_table(problems)]
    return out


def _summary(table: pd.DataFrame, cohorts: list[Cohort]) -> list[Block]:
    verdicts: list = []
    blocks: list[Block] = [Heading("This machine, point by point"), Paragraph(
        "One line per point: the fastest cache where its 95% interval clears the next one's, else a tie "
        "(`apart`: compared across runs, not round by round); what the plain cache saves against recomputing, "
        "in time and in FLOPs (far larger: a cached step waits on bytes); peak memory split."),
        summary_table(cohorts, verdicts)]
    blocks.append(resolution_paragraph(verdicts))
    noisy = int(noisy_flags(table[table["status"] == "ok"]).sum()) if "status" in table else 0
    if noisy:
        blocks.append(Paragraph(noisy_note(noisy)))
    if not cohorts:
        blocks.append(Paragraph("No row here ran and could be predicted, so there is no point to summarise: the "
                                "rows and their reasons are listed at the end."))
    return blocks


def noisy_note(count: int) -> str:
    """What the report keeps of noisy rows and what it leaves out, and why."""
    return (f"**{count} noisy row(s)**: other processes took the CPUs while they were timed, their steps spread too "
            "far, or they beat the roof (a roof calibrated on a busy machine: re-run with `calibrate=true`); the full "
            "table names each reason. **Kept**, marked `noisy`: their step ratios to the strategies timed in the same "
            "rounds (a busy machine slows every member of a round alike, so the ratio holds, with a wider interval), "
            "the step-ratio and prefill plots, and memory. **Left out**: what sets an absolute time against a roof or "
            "fits a line through times (the step-time plot's points against the roofline, the share of the roof "
            "reached, the unexplained share, the equal batch × tokens throughput, the growth fits).")


def _roofs(table: pd.DataFrame, cohorts: list[Cohort]) -> list[Block]:
    blocks: list[Block] = [Heading("Roofs the predictions use"), Paragraph(
        "Each prediction is a roofline time: max(FLOPs ÷ peak FLOP/s, bytes ÷ bandwidth), per decode step, "
        "averaged over the point's decode steps. Measured roofs (a calibration) are used where one exists; "
        "otherwise a datasheet, named below."), tables.roofs_table(table)]
    if any(g.roof_source == "datasheet" and "stand-in" in g.roof_description for g in cohorts):
        blocks.append(Paragraph("**Note:** some rows have no calibration and no matching datasheet: they are "
                                "predicted with a stand-in datasheet, so their ratios compare this machine "
                                "with that device, not with this machine's own roofs."))
    return blocks


def _every_row(table: pd.DataFrame) -> list[Block]:
    return [Heading("Every row beside its prediction"), Paragraph(
        "Ratios are measured ÷ analytic. Times are per decode step (no_cache: one full recompute), the "
        "prediction averaged over the point's decode steps; `bound` is what the roofline predicts limits "
        "that step. Bytes per step come from a hardware counter where one ran (`ncu`), else from the "
        "runner's model, which is the analytic one (no ratio then). Cache: bytes allocated against "
        "batch × (ctx + decode_tokens) × kv_bytes_per_token. Rows that did not run are listed at the end; "
        "columns empty in every row are left out. The same table is `rows.csv` beside this report."),
        tables.rows_table(table)]


def steps_only(table: pd.DataFrame) -> pd.DataFrame:
    """The step measurements of a table, its serving runs left to their own section (its attrs kept)."""
    steps = table[~is_serving(table)]
    steps.attrs = dict(table.attrs)
    return steps


def folders_of(results_dir) -> list[Path]:
    """The results folders a report reads: one, or a list of them."""
    return [Path(f) for f in results_dir] if isinstance(results_dir, (list, tuple)) else [Path(results_dir)]


def build_blocks(results: Results, results_dir: Path, folder: Path,
                 baseline: pd.DataFrame | None = None) -> list[Block]:
    """Every section, each built on its own (harness.report.guard): one that fails leaves its heading
    and a line naming the fault, and the others are built as usual."""
    table = results.rows
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    skipped = table.attrs.get("skipped_files", [])
    blocks: list[Block] = [Heading(TITLE, 1), Paragraph(
        f"Results folder `{table.attrs.get('results_dir', results_dir)}`: {len(table)} rows ({_status_counts(table)}); "
        f"{len(skipped)} files not read (listed at the end). Written {stamp}.")]
    if table.empty:
        return blocks + [Paragraph(
            f"**No rows to report.** `{results_dir}` holds no readable `*.parquet` row. Measure some first, "
            f"e.g. `python -m harness.run +sweep=batch_ctx results_dir={results_dir}`.")] + _not_measured(table)
    serving = ("Serving", lambda: serving_section(table, folders_of(results_dir), folder), True)
    if is_serving(table).all():  # serving runs alone: no decode step to set against a prediction
        return blocks + apart.built([serving, ("Rows and files not measured", lambda: _not_measured(table), False)],
                                    len(table))
    everything = table
    if is_serving(table).any():  # the step sections read the step measurements alone
        results = Results.of(steps_only(table))
        table = results.rows
    analytic = results.tables  # every analytic figure beyond the rows' own columns (the loader's)
    cohorts = cohorts_of(results)
    sets_by_cohort = {g.slug: tables.equal_product_sets(g.ok) for g in cohorts}
    # (heading, build, whether it draws plots: those may be built in a forked process, harness.report.apart)
    trades = (COMPRESSION_HEADING, lambda: compression_section(cohorts, folder), True)
    # Rows of caches that keep fewer tokens, layers or channels answer one question first: what that buys
    # and costs (+sweep=kv_compression), so its picture leads; elsewhere it keeps its place among the others.
    leads = any(compressed(ran_rows(g)).any() for g in cohorts)
    sections = [trades] if leads else []
    sections.append(("This machine, point by point", lambda: _summary(table, cohorts), False))
    if baseline is not None:
        sections.append(("Against the baseline", lambda: compare.comparison_section(table, baseline, folder), True))
    sections += [(f"Measured against predicted: {g.title}", lambda g=g: _cohort_section(g, folder, sets_by_cohort[g.slug]),
                  True) for g in cohorts[:MAX_PLOTTED_COHORTS]]
    if len(cohorts) > MAX_PLOTTED_COHORTS:  # a folder of many models and machines: a bounded number of plots
        sections.append(("Cohorts not drawn", lambda: [Heading("Cohorts not drawn"), Paragraph(
            f"This folder holds {len(cohorts)} cohorts (model, machine, dtype, linear kernel); the "
            f"{MAX_PLOTTED_COHORTS} with the most rows are drawn above, so that the report stays bounded. The others' "
            "rows are in every table: " + ", ".join(f"{g.title}" for g in cohorts[MAX_PLOTTED_COHORTS:]) + ".")], False))
    sections += [
        ("Roofs the predictions use", lambda: _roofs(table, cohorts), False),
        ("Every row beside its prediction", lambda: _every_row(table), False),
        ("Which layout wins where", lambda: layout_section(cohorts, folder), True),
        ("What fewer bytes buy", lambda: format_section(cohorts, folder), True),
        *([] if leads else [trades]),
        ("Against the engines", lambda: engine_section(table), False),
        ("What the roofline does not explain", lambda: overhead_section(cohorts, folder), True),
        ("What a KV cache buys and costs: the questions, answered", lambda: answers(table, cohorts, sets_by_cohort, analytic),
         False),
        *([serving] if is_serving(everything).any() else []),
        ("Rows and files not measured", lambda: _not_measured(everything), False),
    ]
    return blocks + apart.built(sections, len(table))


def build_report(results_dir, fallback_hardware: str = DEFAULT_FALLBACK_HARDWARE, out_dir=None,
                 baseline=None) -> ReportFiles:
    """Read every row of results_dir and write <out_dir>/report.md and index.html (and the PNGs).

    Checked before anything is written, by the checks the runner uses (harness.config.validate):
    results_dir a folder, or a list of folders read as one table (several hosts or GPU types), out_dir
    (default <the first results_dir>/_report) a folder that can be written and in which the report's
    files would not be read as rows (harness.report.outputs), baseline (optional: a section compares with
    its rows, harness.report.compare) a folder that can be read, and the fallback datasheet. A fault while
    writing (a full disk) is a ReportError naming `out`; report.md, rows.csv and index.html are each
    replaced whole or not at all, and the files of an earlier report are removed only once they are."""
    try:
        many = not isinstance(results_dir, (str, Path))
        folders = [input_folder("results_dir", one) for one in (results_dir if many else [results_dir])]
        if not folders:
            raise ConfigError("results_dir", "names no folder")
        results_dir = folders if many else folders[0]
        baseline = compare.baseline_folder(baseline) if baseline is not None else None
        folder = output_folder("out", out_dir) if out_dir is not None else folders[0] / REPORT_DIR
        if out_dir is None:
            output_folder("results_dir", folder)
        refuse_results_folder("out", folder, folders + ([baseline] if baseline is not None else []))
        results = read_results(results_dir, fallback_hardware, left_out=UNREAD_COLUMNS)
        compared = read_results(baseline, fallback_hardware, left_out=UNREAD_COLUMNS).rows if baseline is not None else None
    except ConfigError as error:
        raise ReportError(str(error)) from None
    key = "out" if out_dir is not None else "results_dir"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        outputs = Outputs(folder)
        blocks = build_blocks(results, results_dir, folder, compared)
        files = ReportFiles(markdown=folder / "report.md", html=folder / "index.html", csv=folder / "rows.csv",
                            figures=[b.path for b in blocks if isinstance(b, Figure)])
        written = [files.markdown, *([files.csv] if not results.rows.empty else []), files.html]
        for path in written:
            claim(path)
        write_whole(files.markdown, to_markdown(blocks))
        if not results.rows.empty:  # rendered from the rows, as the Markdown table is: numbers, under the columns' names
            write_whole(files.csv, tables.rows_csv(results.rows))
        write_whole(files.html, to_html(blocks, TITLE))
        outputs.finish(written + files.figures)
    except OSError as error:
        raise ReportError(f"{key}: cannot write the report to '{folder}': {error.strerror or error}") from None
    return files

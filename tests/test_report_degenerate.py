"""The report on legal but degenerate results folders: every one builds, every section it can is drawn,
and a section that cannot show its subject says so in a short line instead of costing the report (or
another section) a traceback.

Each case is a folder a real sweep can leave: numeric columns null in every row, metrics at or below 0,
infinite values, a single row, one strategy only, only the recompute reference, no reference at all,
only skipped and failed rows, every row noisy, no calibration, rows of an older schema beside current
ones, the same point written twice, rows the analytic model cannot predict, quantized rows without an
accuracy pass.
"""
from __future__ import annotations

import math

import pandas as pd
import pytest

from harness.report import assemble, kv_formats, plots
from harness.report.assemble import build_report
from harness.report.guard import NOT_DRAWN
from harness.store.files import row_filename, write_row
from tests.report_fixtures import row, write_calibration, write_variant_results

SECTIONS = ("This machine, point by point", "Roofs the predictions use", "Every row beside its prediction",
            "Which layout wins where", "What fewer bytes buy", "What compressing the cache trades",
            "What the roofline does not explain",
            "Eager against compiled", "What a KV cache buys and costs", "Rows and files not measured")
MEASURED_FLOATS = ("prefill_s", "decode_step_s", "decode_step_p10_s", "decode_step_p90_s", "tokens_per_s")
MEASURED_BYTES = ("kv_cache_bytes", "peak_memory_bytes")


def rows(strategies=("no_cache", "contiguous"), batches=(1, 4), contexts=(64, 256), **changes) -> list[dict]:
    found = [row(s, b, c) for s in strategies for b in batches for c in contexts]
    return [{**r, **changes} for r in found]


def write(folder, written: list[dict], calibration: bool = True) -> None:
    for one in written:
        write_row(folder, one)
    if calibration:
        write_calibration(folder)


def all_nan(folder):
    write(folder, rows(**dict.fromkeys(MEASURED_FLOATS, math.nan), **dict.fromkeys(MEASURED_BYTES)))


def not_positive(folder):
    write(folder, rows(strategies=("no_cache", "contiguous", "quantized"), decode_step_s=0.0, prefill_s=-1.0,
                       tokens_per_s=0.0, kv_cache_bytes=0, peak_memory_bytes=0))


def infinite(folder):
    written = rows(strategies=("no_cache", "contiguous", "quantized"))
    for one in written[::2]:
        one.update(decode_step_s=math.inf, tokens_per_s=math.inf, prefill_s=math.inf)
    for one in written:
        if one["strategy"] == "quantized":
            one.update(logit_kl_mean=math.inf)
    write(folder, written)


def single_row(folder):
    write(folder, [row("contiguous", 1, 64)])


def one_cache_only(folder):
    write(folder, rows(strategies=("contiguous",)))


def reference_only(folder):
    write(folder, rows(strategies=("no_cache",)))


def no_reference(folder):
    write(folder, rows(strategies=("contiguous", "quantized")))


def nothing_ran(folder):
    write(folder, [row("flash", 1, 64, "skipped", "flash needs CUDA"),
                   row("contiguous", 64, 4096, "failed", "RuntimeError: out of memory")])


def all_noisy(folder):
    write(folder, rows(noisy=True, noise_reason="other processes took 40% of the CPUs"))


def no_calibration(folder):
    write(folder, rows(), calibration=False)


def older_schema(folder):
    """Half the rows as an older harness wrote them: only the identity and the first measured columns."""
    write(folder, rows(contexts=(64,)))
    kept = ["strategy", "model", "vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn_dim",
            "dtype", "device", "batch", "ctx", "decode_tokens", "status", "caches_kv", "exact", "decode_step_s",
            "prefill_s", "tokens_per_s", "kv_cache_bytes", "point_key"]
    for one in rows(contexts=(256,)):
        pd.DataFrame([{k: one[k] for k in kept}]).to_parquet(folder / row_filename(one), index=False)


def duplicated(folder):
    """The same points twice: a re-run under another key, the same timestamp (a copy of a folder)."""
    written = rows()
    write(folder, written + [{**one, "point_key": one["point_key"] + "-again"} for one in written])


def unpredictable(folder):
    """Rows of a dtype the analytic model does not know (a later harness's): no roof, no prediction, no
    group to plot, beside rows it predicts."""
    write(folder, rows(contexts=(64,)) + rows(contexts=(256,), dtype="float64"))


def no_accuracy_pass(folder):
    write(folder, rows(strategies=("no_cache", "contiguous", "quantized"), top1_agreement=None, logit_kl_mean=None,
                       logit_max_abs_error=None, accuracy_reference="prefill=random: no prompt ran"))


def variants_of_an_older_schema(folder):
    """Cache variants without the columns the accuracy pass added later (KL interval, p99, max,
    perplexity ratio, tokens scored), nor the group's paired ratio."""
    write_variant_results(folder, contexts=(256,))
    for path in folder.glob("*.parquet"):
        frame = pd.read_parquet(path)
        frame.drop(columns=[c for c in frame.columns if c.startswith(("logit_kl_p", "logit_kl_max", "logit_kl_mean_ci",
                                                                       "perplexity_ratio", "accuracy_", "ratio_"))]
                   ).to_parquet(path, index=False)


CASES = {  # case -> a line its report must hold (beyond every section's heading)
    all_nan: "left out of every plot and ratio",
    not_positive: "left out of every plot and ratio",
    infinite: "left out of every plot and ratio",
    single_row: "No two rows of one cached strategy share batch × ctx",
    one_cache_only: "Needs `no_cache` and a cached strategy at the same batch and context",
    reference_only: "No point here ran two caches",
    no_reference: "Needs `no_cache` and a cached strategy at the same batch and context",
    nothing_ran: "No ok row with a decode time",
    all_noisy: "**Kept**, marked `noisy`",
    no_calibration: "stand-in",
    older_schema: "Every row beside its prediction",
    duplicated: "Every row beside its prediction",
    unpredictable: "could not be predicted",
    no_accuracy_pass: "no approximate variant here has a measured KL",
    variants_of_an_older_schema: "Not recorded in these rows",
}


# A report takes about 2 s a folder on 2 cores, most of it drawing plots: the fast tier builds the
# folders a plot can fail on (numbers null, at or below 0, infinite) and those that leave a section without
# its subject; the others, whose plots hold nothing new, are in the slow tier.
IN_THE_FAST_TIER = {all_nan, not_positive, infinite, single_row, no_reference, nothing_ran, no_accuracy_pass}


@pytest.mark.parametrize("case", [case if case in IN_THE_FAST_TIER else pytest.param(case, marks=pytest.mark.slow)
                                  for case in CASES], ids=[case.__name__ for case in CASES])
def test_a_degenerate_folder_gets_every_section_and_says_what_it_could_not_draw(case, tmp_path):
    folder = tmp_path / "results"
    folder.mkdir()
    case(folder)
    files = build_report(folder, out_dir=tmp_path / "report")
    text = files.markdown.read_text()
    for heading in SECTIONS:
        assert f"## {heading}" in text, heading
    assert NOT_DRAWN not in text, text[text.index(NOT_DRAWN) - 300:text.index(NOT_DRAWN) + 300]
    assert CASES[case] in text
    assert files.html.is_file()


def test_a_section_that_fails_costs_only_itself(tmp_path, monkeypatch):
    """A fault nobody foresaw, in one plot and in one section: both say so in a line, every other
    section and plot is still drawn."""
    def broken(*args, **kwargs):
        raise RuntimeError("an unforeseen fault\nwith a second line")

    monkeypatch.setattr(plots, "cache_bytes_vs_tokens", broken)
    monkeypatch.setattr(assemble, "format_section", broken)
    folder = tmp_path / "results"
    folder.mkdir()
    write(folder, rows())
    files = build_report(folder, out_dir=tmp_path / "report")
    text = files.markdown.read_text()
    assert text.count(f"{NOT_DRAWN}: RuntimeError: an unforeseen fault)*") == 2, text
    assert "## What fewer bytes buy" in text and "with a second line" not in text
    for heading in SECTIONS:
        assert f"## {heading}" in text, heading
    assert len(files.figures) >= 4  # step time, no cache over cache, prefill and decode, peak memory
    assert kv_formats.format_section is not broken  # the module's own function is untouched

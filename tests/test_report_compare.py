"""Two runs compared (`python -m harness.report results_dir=A baseline=B`, harness.report.compare) on
folders the real runner measured on the tiny model, then edited with pyarrow so each verdict is known."""
from __future__ import annotations

import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from harness.analysis.results import load
from harness.report import compare
from harness.report.__main__ import main as report_main
from harness.report.assemble import build_report
from harness.store.files import write_row
from tests.conftest import copy_sweep

SLOWED = "b=2 ctx=32"  # the point of `contiguous` a copy slows down (see _slow_contiguous_ctx32)


def edit_rows(folder: Path, change) -> None:
    """Rewrite every row of the folder through the runner's writer, `change(row)` applied in place."""
    for path in sorted(folder.glob("*.parquet")):
        row = pq.read_table(path).to_pylist()[0]
        change(row)
        path.unlink()  # an edit of ctx or strategy would give the row another file name
        write_row(folder, row)


def steady(row: dict) -> None:
    """A quiet machine and a narrow spread (p10, p90 = 0.9, 1.1 x median): the two CPUs here are shared,
    so the measured rows are noisy; after this only the edits below decide a verdict."""
    row.update(noisy=False, noise_reason="", decode_step_p10_s=0.9 * row["decode_step_s"],
               decode_step_p90_s=1.1 * row["decode_step_s"])


def slow(row: dict, factor: float = 2.0) -> None:
    """The row as a run `factor` times slower would record it: step times up, rates and fractions down."""
    for column in ("decode_step_s", "decode_step_p10_s", "decode_step_p90_s"):
        row[column] *= factor
    for column in ("tokens_per_s", "bandwidth_fraction", "flops_fraction", "roofline_fraction"):
        row[column] /= factor


def _slow_contiguous_ctx32(row: dict) -> None:
    if row["caches_kv"] and row["ctx"] == 32:
        slow(row)


@pytest.fixture(scope="module")
def measured(tiny_sweep, tmp_path_factory) -> Path:
    """no_cache and contiguous at batch 2, ctx 16 and 32, as the runner measured them in the session's
    sweep (tests/conftest.py), then made steady."""
    folder = copy_sweep(tiny_sweep, tmp_path_factory.mktemp("measured") / "results",
                        keep=lambda row: row["strategy"] in ("no_cache", "contiguous"))
    edit_rows(folder, steady)
    assert len(list(folder.glob("*.parquet"))) == 4
    return folder


def copy_of(measured: Path, tmp_path: Path, name: str, change=None) -> Path:
    folder = Path(shutil.copytree(measured, tmp_path / name, ignore=shutil.ignore_patterns("_report", "_hydra")))
    if change is not None:
        edit_rows(folder, change)
    return folder


def section(markdown: Path) -> str:
    text = markdown.read_text()
    start = text.index("## Against the baseline")
    return text[start:text.index("\n## ", start)]


def table_lines(text: str) -> dict[str, str]:
    """'<strategy> ctx=<ctx>' -> the section table's line of that point."""
    lines = [line for line in text.splitlines() if line.startswith("| ") and "|:---" not in line][1:]
    return {f"{cells[0]} ctx={cells[5]}": line for line in lines
            for cells in [[c.strip() for c in line.strip("|").split("|")]]}


def test_a_doubled_point_is_slower_beyond_noise_and_unchanged_ones_are_not(measured, tmp_path):
    def slowed_and_one_noisy(row):
        _slow_contiguous_ctx32(row)
        if not row["caches_kv"] and row["ctx"] == 16:  # slower too, but noisy: named, never judged
            slow(row)
            row.update(noisy=True, noise_reason="planted: other processes took the CPUs")

    this = copy_of(measured, tmp_path, "this", slowed_and_one_noisy)
    files = build_report(this, baseline=measured)
    text = files.markdown.read_text()
    assert text.index("## This machine, point by point") < text.index("## Against the baseline") \
        < text.index("## Measured against predicted")
    part = section(files.markdown)
    assert "4 point(s) in both runs; 0 point(s) only in the baseline, 0 only in this run" in part
    assert "**Different devices**" not in part
    slower = part.split("### Slower beyond noise: 1 of 4 point(s)")[1].split("\n\n")[1]
    assert slower.startswith("- contiguous") and SLOWED in slower and slower.count("\n- ") == 0
    noisy = part.split("**1 point(s) noisy**")[1].split("\n\n")[1]
    assert noisy.startswith("- no_cache") and "ctx=16" in noisy and "planted: other processes" in noisy
    lines = table_lines(part)
    assert "| 2x |" in lines["contiguous ctx=32"] and lines["contiguous ctx=32"].endswith("| slower beyond noise |")
    for unchanged in ("contiguous ctx=16", "no_cache ctx=32"):
        assert "| 1x |" in lines[unchanged] and lines[unchanged].endswith("| within noise |"), lines[unchanged]
    assert lines["no_cache ctx=16"].endswith("| noisy |")
    plot = files.markdown.parent / compare.PLOT_NAME
    assert plot in files.figures and plot.read_bytes()[:4] == b"\x89PNG"

    reverse = compare.compare(load(measured), load(this)).points  # the same pair seen from the other side
    assert list(reverse.loc[reverse["ctx"] == 32, "verdict"]) == ["faster beyond noise", "within noise"]


def test_a_baseline_that_is_not_a_folder_is_one_line_and_exit_2(measured, tmp_path, capsys):
    (tmp_path / "a_file").write_text("not a folder")
    for baseline in (tmp_path / "missing", tmp_path / "a_file", ""):
        assert report_main([f"results_dir={measured}", f"baseline={baseline}"]) == 2
        error = capsys.readouterr().err
        assert error.startswith("baseline: ") and error.count("\n") == 1, error
    assert not (measured / "_report").exists()  # refused before anything was written


def test_a_baseline_with_no_point_in_common_says_so_without_a_plot(measured, tmp_path):
    other_steps = copy_of(measured, tmp_path, "other", lambda row: row.update(decode_tokens=8))
    files = build_report(measured, out_dir=tmp_path / "report", baseline=other_steps)
    part = section(files.markdown)
    assert "0 point(s) in both runs; 4 point(s) only in the baseline, 4 only in this run" in part
    assert "**No point is in both runs**" in part and "| verdict |" not in part
    assert not (tmp_path / "report" / compare.PLOT_NAME).exists()

    (tmp_path / "empty").mkdir()
    files = build_report(measured, out_dir=tmp_path / "report", baseline=tmp_path / "empty")
    assert "0 point(s) in both runs; 0 point(s) only in the baseline, 4 only in this run" in section(files.markdown)


def test_across_devices_the_roof_fraction_leads_and_decides(measured, tmp_path):
    this = copy_of(measured, tmp_path, "this", _slow_contiguous_ctx32)
    elsewhere = copy_of(measured, tmp_path, "elsewhere", lambda row: row.update(device_name="Another CPU (planted)"))
    files = build_report(this, baseline=elsewhere)
    part = section(files.markdown)
    assert "**Different devices**" in part and "baseline: Another CPU (planted)" in part
    header = next(line for line in part.splitlines() if line.startswith("| strategy |"))
    assert header.index("of its roof") < header.index("baseline step")
    assert "### Slower beyond noise: 1 of 4 point(s)" in part
    line = table_lines(part)["contiguous ctx=32"]
    assert "| 0.5x |" in line and line.endswith("| slower beyond noise |")  # half the roof reached
    assert "roof fraction per point" in files.markdown.read_text()  # the plot's caption

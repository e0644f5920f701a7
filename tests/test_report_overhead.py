"""The report's overhead sections (harness/report/overhead.py): the share of a cached step the roofline
does not explain, and eager against compiled where a sweep ran both modes."""
from __future__ import annotations

import pandas as pd
import pytest

from harness.analysis.results import Results, load
from harness.report.assemble import build_report
from harness.report.document import to_markdown
from harness.report.cohorts import cohorts_of
from harness.report.overhead import overhead_section, unexplained
from harness.store.files import write_row
from tests.report_fixtures import SLOWDOWN, write_results

POINTS = dict(calibration=True, awkward=False, batches=(1, 4), contexts=(64, 256))


def _section(text: str, heading: str) -> str:
    part = text[text.index(f"## {heading}"):]
    end = part.find("\n## ", 1)
    return part if end < 0 else part[:end]


def overhead_markdown(folder, tmp_path) -> str:
    """The two overhead sections as the report writes them, without drawing the report's plots (the
    whole report is built once, by test_unexplained_share_is_one_minus_roofline_over_measured)."""
    return to_markdown(overhead_section(cohorts_of(Results.of(load(folder))), tmp_path))


def with_compiled(folder, factor: float = 0.5, keep=lambda row: True):
    """Add a compile=inductor copy of each cached row that `keep` accepts, its step `factor` times the
    eager one; the eager rows get compile=none, except one left null as rows written before the column."""
    for i, path in enumerate(sorted(folder.glob("*.parquet"))):
        row = pd.read_parquet(path).iloc[0].to_dict()
        if not row["caches_kv"]:
            continue
        path.unlink()
        write_row(folder, {**row, "compile": None if i == 0 else "none"})
        if keep(row):
            step = row["decode_step_s"] * factor
            write_row(folder, {**row, "compile": "inductor", "compile_mode": "inductor", "compile_s": 12.5,
                               "compile_recompiles": 0, "decode_step_s": step, "decode_step_p10_s": 0.95 * step,
                               "decode_step_p90_s": 1.1 * step, "point_key": row["point_key"] + "-inductor"})
    return folder


def test_unexplained_share_is_one_minus_roofline_over_measured(tmp_path):
    table = load(write_results(tmp_path / "r", **POINTS))
    found = unexplained(cohorts_of(Results.of(table))[0].ok)
    assert len(found) == 4 and found["caches_kv"].all()  # cached rows only: the reference is not there
    r = found.iloc[0]
    assert r["share"] == pytest.approx(1 - r["predicted_step_s"] / r["decode_step_s"])
    assert r["share"] == pytest.approx(1 - 1 / SLOWDOWN[r["strategy"]])  # the fixture's 2x: half unexplained
    text = build_report(tmp_path / "r", out_dir=tmp_path / "out").markdown.read_text()
    section = _section(text, "What the roofline does not explain")
    assert "Median unexplained share: 50% of the step, over 4 point(s)." in section
    assert "dispatch" in section and "| 50% |" in section
    assert f"| {(r['decode_step_s'] - r['predicted_step_s']) * 1e3:.3g} ms |" in section


def test_a_row_faster_than_its_roof_is_clipped_at_zero_and_called_noisy(tmp_path):
    table = load(write_results(tmp_path / "r", **POINTS))
    cached = table["caches_kv"].fillna(False).astype(bool) & (table["status"] == "ok")
    first = cached[cached].index[0]
    table.loc[first, "decode_step_s"] = table.loc[first, "predicted_step_s"] / 2
    found = unexplained(cohorts_of(Results.of(table))[0].ok)
    assert found["share"].min() == 0 and found["faster"].sum() == 1
    text = "\n".join(getattr(b, "text", "") for b in overhead_section(cohorts_of(Results.of(table)), tmp_path))
    assert "1 row(s) ran faster than the roofline allows" in text


def test_eager_against_compiled_shows_the_speedup_of_paired_points_only(tmp_path):
    folder = with_compiled(write_results(tmp_path / "r", **POINTS), keep=lambda row: row["ctx"] == 64)
    text = overhead_markdown(folder, tmp_path)
    section = _section(text, "Eager against compiled")
    lines = [line for line in section.splitlines() if line.startswith("| contiguous")]
    assert len(lines) == 2 and all("| 64 |" in line for line in lines)  # ctx=256 ran eager only: not shown
    assert all("| 2x | 12.5 | 0 |" in line for line in lines)
    assert "Median speedup: 2x over 2 point(s)." in section
    # both modes appear in the unexplained table, the null compile read as eager
    unexplained_part = _section(text, "What the roofline does not explain")
    assert unexplained_part.count("| contiguous | none |") == 4 and unexplained_part.count("| inductor |") == 2


def test_without_compiled_rows_the_section_gives_the_sweep_that_would(tmp_path):
    text = overhead_markdown(write_results(tmp_path / "r", **POINTS), tmp_path)
    section = _section(text, "Eager against compiled")
    assert ("`python -m harness.run -m model=cpu_small strategy=contiguous compile=none,inductor "
            "batch=1,4 ctx=256,1024 device=cpu`") in section
    assert "| series |" not in section  # no empty table


def test_no_groups_no_crash(tmp_path):
    blocks = overhead_section([], tmp_path)
    text = "\n".join(getattr(b, "text", "") for b in blocks)
    assert "No cached strategy" in text and "`python -m harness.run -m compile=none,inductor " in text  # defaults


def test_a_roof_set_by_a_stream_is_set_beside_the_matrix_vector_read(tmp_path):
    """Rows that recorded the calibration's best matrix-vector read below the roof: the report says how
    much of each step that alone leaves unexplained; at the roof, that it set the roof."""
    folder = write_results(tmp_path / "r", **{**POINTS, "row_roofs": True})
    for path in sorted(folder.glob("*.parquet")):
        row = pd.read_parquet(path).iloc[0].to_dict()
        path.unlink()
        write_row(folder, {**row, "roof_bandwidth_gemv_Bps": 0.6 * row["roof_bandwidth_Bps"]})
    section = _section(overhead_markdown(folder, tmp_path), "What the roofline does not explain")
    assert "its best matrix-vector product, the kind of read a step makes, reached" in section
    assert "would already leave 40% of its time unexplained" in section
    table = load(folder)
    table["roof_bandwidth_gemv_Bps"] = table["roof_bandwidth_Bps"]
    text = "\n".join(getattr(b, "text", "") for b in overhead_section(cohorts_of(Results.of(table)), tmp_path))
    assert "is the calibration's matrix-vector read" in text and "already leave" not in text

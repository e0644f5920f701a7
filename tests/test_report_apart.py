"""The plotting sections built in a forked process (harness.report.apart, a large folder's report): the same
report, plots and all, as every section built in one process; a plot's fault there still costs only that
plot; and a forked process that dies leaves its sections to be built in the report's own.
"""
from __future__ import annotations

import os
import re
import sys

import pytest

from harness.report import apart, plots
from harness.report.assemble import build_report
from harness.report.guard import NOT_DRAWN
from tests.report_fixtures import write_results, write_variant_results

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="sections are built apart on Linux only")
WRITTEN = re.compile(r"Written [^.]*UTC")


def built(folder, out, monkeypatch, apart_from_rows: int) -> tuple[str, dict]:
    """report.md (timestamp aside) and each plot's bytes, the sections apart from `apart_from_rows` rows."""
    monkeypatch.setattr(apart, "APART_MIN_ROWS", apart_from_rows)
    files = build_report(folder, out_dir=out)
    return WRITTEN.sub("", files.markdown.read_text()), {path.name: path.read_bytes() for path in files.figures}


@pytest.mark.parametrize("write", [write_results, write_variant_results], ids=["awkward rows", "cache variants"])
def test_sections_built_apart_make_the_report_built_in_one_process(tmp_path, monkeypatch, write):
    folder = write(tmp_path / "results")
    forks = []  # whether each report built its plotting sections apart
    real_built = apart.built
    monkeypatch.setattr(apart, "built", lambda sections, rows: (forks.append(rows >= apart.APART_MIN_ROWS),
                                                                real_built(sections, rows))[1])
    here = built(folder, tmp_path / "here", monkeypatch, 10 ** 9)
    away = built(folder, tmp_path / "apart", monkeypatch, 0)
    assert forks == [False, True]
    assert away[0] == here[0] and away[1] == here[1] and here[1]


def test_a_plot_that_fails_in_the_forked_process_costs_only_that_plot(tmp_path, monkeypatch):
    folder = write_variant_results(tmp_path / "results")

    def broken(*args, **kwargs):
        raise RuntimeError("drawn wrong")

    monkeypatch.setattr(plots, "step_ratio_vs_context", broken)
    here = built(folder, tmp_path / "here", monkeypatch, 10 ** 9)
    away = built(folder, tmp_path / "apart", monkeypatch, 0)
    assert away == here and f"this plot {NOT_DRAWN}: RuntimeError: drawn wrong" in away[0]


def test_a_forked_process_that_dies_leaves_its_sections_to_this_one(tmp_path, monkeypatch):
    folder = write_variant_results(tmp_path / "results")
    here = built(folder, tmp_path / "here", monkeypatch, 10 ** 9)
    monkeypatch.setattr(apart, "_build", lambda sections: os._exit(1))
    assert built(folder, tmp_path / "apart", monkeypatch, 0) == here

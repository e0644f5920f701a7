"""Every figure the report saves, checked as saved: no text cut at the figure's edge (a title of a long
CPU and linear-kernel name, an axis's tick labels, a legend) and no legend drawn over a measured point
or bar. Each figure is inspected right after its savefig, when it is laid out exactly as written."""
from __future__ import annotations

import re

import numpy as np
import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.transforms import Bbox
from matplotlib.text import Text

from harness.report.assemble import build_report
from harness.store.files import write_row
from tests.report_fixtures import CPU_ROOF, row, variant_row, write_row_as_is

# As a real row names them (an AMD EPYC VM's processor, the C linear kernel's description): the
# lengths that cut the titles at both edges.
DEVICE_NAME = "AMD EPYC 7551P 32-Core Processor (2 threads)"
MATMUL_KERNEL = ("cpu_gemv.c (fp32, OpenMP) up to 16 rows (decoder blocks in two calls, linears), aten above")
TOLERANCE = 1.0  # pixels: antialiasing at an edge


def long_named(one: dict) -> dict:
    return {**one, "device_name": DEVICE_NAME, "matmul_kernel": MATMUL_KERNEL,
            "roof_bandwidth_Bps": CPU_ROOF.bytes_per_s, "roof_flops": CPU_ROOF.flops_per_s}


def inside(box, outer) -> bool:
    return (box.x0 >= outer.x0 - TOLERANCE and box.x1 <= outer.x1 + TOLERANCE
            and box.y0 >= outer.y0 - TOLERANCE and box.y1 <= outer.y1 + TOLERANCE)


def cut_texts(fig: Figure, renderer) -> list[str]:
    """Texts drawn partly outside the figure: titles, labels, legend entries, annotations one by one, and
    each axis's drawn tick labels together (an axis's tight box holds only the ticks it draws)."""
    tick_labels = {id(t) for ax in fig.axes for axis in (ax.xaxis, ax.yaxis)
                   for t in axis.get_ticklabels(minor=False) + axis.get_ticklabels(minor=True)}
    cut = [f"text {t.get_text()!r}" for t in fig.findobj(Text)
           if id(t) not in tick_labels and t.get_visible() and t.get_text().strip()
           and not inside(t.get_window_extent(renderer), fig.bbox)]
    for ax in fig.axes:
        for name, axis in (("x", ax.xaxis), ("y", ax.yaxis)):
            box = axis.get_tightbbox(renderer)
            if box is not None and not inside(box, fig.bbox):
                cut.append(f"{name} axis of {ax.get_title()!r}")
    return cut


def covered_data(fig: Figure, renderer) -> list[str]:
    """Measured points (a line's markers) and bars that a legend's box covers, and any plotting area it
    reaches into (where the next run's points may fall)."""
    legends = list(fig.legends) + [ax.get_legend() for ax in fig.axes if ax.get_legend() is not None]
    covered = []
    for legend in legends:
        box = legend.get_window_extent(renderer)
        for ax in fig.axes:
            overlap = Bbox.intersection(box, ax.bbox)
            if overlap is not None and overlap.width > TOLERANCE and overlap.height > TOLERANCE:
                covered.append(f"the plotting area of {ax.get_title()!r}")
            for line in ax.get_lines():
                if line.get_marker() in (None, "", " ", "None") or not line.get_visible():
                    continue
                points = line.get_transform().transform(np.asarray(line.get_xydata(), float))
                points = points[np.isfinite(points).all(axis=1)]
                drawn = [p for p in points if ax.bbox.contains(*p)]
                covered += [f"point {line.get_label()!r} at {p.round()}" for p in drawn if box.contains(*p)]
            for bar in ax.patches:
                extent = bar.get_window_extent(renderer)
                if extent.width > 0 and extent.height > 0 and box.overlaps(extent) and ax.bbox.overlaps(extent):
                    covered.append(f"bar {bar.get_label()!r}")
    return covered


@pytest.fixture(scope="module")
def saved_figures(tmp_path_factory):
    """Every figure of two reports (every plot the report draws), inspected at its savefig."""
    found: dict[str, list[str]] = {}
    real_savefig = Figure.savefig

    def inspecting_savefig(fig, path, *args, **kwargs):
        fig.set_dpi(kwargs.get("dpi", fig.dpi))  # laid out as savefig will lay it out: at the file's resolution
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        name = str(getattr(path, "name", path)).rsplit("/", 1)[-1]  # a file handle: harness.files.write_whole's
        found[re.sub(r"^\.(.*)\.tmp-\d+$", r"\1", name)] = ([f"cut: {c}" for c in cut_texts(fig, renderer)]
                                              + [f"under a legend: {c}" for c in covered_data(fig, renderer)])
        real_savefig(fig, path, *args, **kwargs)

    patch = pytest.MonkeyPatch()
    patch.setattr(Figure, "savefig", inspecting_savefig)
    try:
        plain = tmp_path_factory.mktemp("plain")
        for strategy in ("no_cache", "contiguous", "quantized"):
            for batch in (1, 4):
                for ctx in (64, 256, 1024):
                    write_row(plain, long_named(row(strategy, batch, ctx)))
        build_report(plain, out_dir=tmp_path_factory.mktemp("plain_report"), baseline=plain)
        variants = tmp_path_factory.mktemp("variants")
        for name in ("contiguous", "paged32", "int8", "fp8", "kivi4", "int4"):
            for ctx in (256, 1024):
                write_row_as_is(variants, long_named(variant_row(name, 4, ctx)))
        build_report(variants, out_dir=tmp_path_factory.mktemp("variants_report"))
    finally:
        patch.undo()
    return found


PLOTS = ("step_time", "step_time_layouts", "step_ratio", "no_cache_over_cache", "cache_bytes", "prefill_vs_decode",
         "equal_batch_tokens", "peak_memory", "bytes_vs_kl", "compare_baseline")


def drawn(saved_figures: dict, plot: str) -> dict:
    """The saved figures of one plot function (file names start with the plot's name)."""
    return {name: problems for name, problems in saved_figures.items()
            if (name == f"{plot}.png" or name.startswith(plot + "_"))
            and not (plot == "step_time" and name.startswith("step_time_layouts_"))}


def test_every_plot_the_report_draws_is_checked(saved_figures):
    for plot in PLOTS:
        assert drawn(saved_figures, plot), (plot, sorted(saved_figures))


@pytest.mark.parametrize("plot", PLOTS)
def test_no_text_is_cut_and_no_legend_covers_a_point(saved_figures, plot):
    for name, problems in drawn(saved_figures, plot).items():
        assert not problems, f"{name}: {problems}"


def test_the_checks_catch_a_cut_title_and_a_legend_over_a_point():
    """The two checks against a figure drawn as the report drew them before: a centred title wider than
    the figure, a legend inside the axes over the points."""
    fig = Figure(figsize=(5, 3))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.plot([0, 1, 2], [0, 1, 2], "o", label="measured")
    ax.set_title(f"What a cache saves\ncpu_small · cpu ({DEVICE_NAME}) · float32 · {MATMUL_KERNEL}")
    ax.legend(loc="center")
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    assert any("What a cache saves" in c for c in cut_texts(fig, renderer))
    assert any(c.startswith("point 'measured'") for c in covered_data(fig, renderer))

"""How every plot of the report is laid out: a figure under matplotlib's constrained layout, its title
wrapped to the figure's width, its legend outside the axes, log axes labelled in plain units, and the
PNG written at one resolution.

Constrained layout places the title and the outside legend before it sizes the axes, so neither a
long title (a CPU's full name, a linear kernel's description) nor a legend of many series can be cut
at the figure's edge or drawn over a measured point; tests/test_report_layout.py checks both on
every figure the report saves.
"""
from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Callable, Sequence

import matplotlib

matplotlib.use("Agg")  # no display: the report runs headless
import matplotlib.pyplot as plt  # noqa: E402
import matplotlib.ticker  # noqa: E402
from matplotlib.font_manager import FontProperties  # noqa: E402

from harness.files import write_whole  # noqa: E402
from harness.report.outputs import claim  # noqa: E402

DPI = 110  # every PNG's resolution
RECOMPUTE_COLOUR = "#d62728"  # the recompute reference, in every plot
PALETTE = ["#1f77b4", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf", "#bcbd22"]  # one per series
MARKERS = ["o", "s", "^", "D", "v", "P", "X", "*"]  # one per series where colour already means something else
TITLE_SIZE = 10  # points: a figure's title
LEGEND_SIZE = 8  # points: legend entries
TITLE_FILL = 0.94  # share of the figure's width a title line may take


def new_figure(width: float, height: float, columns: int = 1, **options):
    """A figure and its axes ([row][column] when columns > 1 or squeeze=False) under constrained layout."""
    return plt.subplots(1, columns, figsize=(width, height), layout="constrained", **options)


def fitted(fig, text: str, budget: float, size: float = TITLE_SIZE) -> str:
    """`text` with each line broken at spaces so that none is wider than `budget` pixels, measured with
    the figure's own renderer and font."""
    renderer = fig.canvas.get_renderer()
    font = FontProperties(size=size)

    def width(line: str) -> float:
        return renderer.get_text_width_height_descent(line, font, ismath=False)[0]

    lines = []
    for line in text.split("\n"):
        if width(line) <= budget:
            lines.append(line)
            continue
        # The widest wrap whose lines all fit: a line of n characters fits about budget / width * n.
        columns = max(8, int(len(line) * budget / width(line)))
        while columns > 8 and any(width(part) > budget for part in textwrap.wrap(line, columns)):
            columns -= 4
        lines += textwrap.wrap(line, columns)
    return "\n".join(lines)


def title(fig, text: str) -> None:
    """The figure's title, wrapped to fit and centred over the part of the figure left of its outside
    legend (call legend_outside first): the legend sits at the top right, beside the title's lines."""
    renderer = fig.canvas.get_renderer()
    legend = max((legend.get_window_extent(renderer).width for legend in fig.legends), default=0.0)
    room = fig.bbox.width - (legend + 12 if legend else 0)  # 12 px: the gap constrained layout leaves
    fig.suptitle(fitted(fig, text, TITLE_FILL * room), fontsize=TITLE_SIZE, x=room / 2 / fig.bbox.width)


def legend_outside(fig, axes: Sequence, title_text: str | None = None, **options) -> None:
    """One legend for the figure, right of every axes (never over a point): each label once, across
    panels where a series is missing from one of them."""
    entries = {}  # label -> handle
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            entries.setdefault(label, handle)
    if entries:
        fig.legend(list(entries.values()), list(entries.keys()), loc="outside right upper", fontsize=LEGEND_SIZE,
                   title=title_text, title_fontsize=LEGEND_SIZE, **options)


def discard_open() -> None:
    """Close every figure still open: what a plot that failed half-way leaves behind."""
    plt.close("all")


def save(fig, folder: Path, name: str) -> Path:
    """Write the figure as `folder/name` through the one atomic writer (harness.files.write_whole): a
    reader, or a report killed half-way, sees the previous PNG or this one, never half of one. Named first
    in the folder's manifest (harness.report.outputs), so that only what the report wrote is ever removed."""
    path = Path(folder) / name
    try:  # savefig runs the constrained layout once, at this resolution, then draws
        claim(path)
        write_whole(path, lambda handle: fig.savefig(handle, format="png", dpi=DPI))
    finally:
        plt.close(fig)
    return path


class _LogTicks(matplotlib.ticker.LogFormatterSciNotation):
    """Labels the ticks matplotlib's log formatter labels (the decades; a few minor ticks on a short axis)
    as plain text ("10 ms", "1 GB", "0.5x") rather than as powers of ten, which read slower and go
    through matplotlib's math-text parser, the costliest part of drawing a report's text."""

    def __init__(self, text: Callable[[float], str]):
        super().__init__()
        self.text = text  # value -> its label

    def __call__(self, x, pos=None) -> str:
        return self.text(x) if super().__call__(x, pos) else ""


def in_units(unit: str) -> Callable[[float], str]:
    """Engineering notation with the unit: 0.01 -> "10 ms" for seconds, 2e9 -> "2 GB" for bytes."""
    return matplotlib.ticker.EngFormatter(unit=unit, sep=" ")


def as_ratio(value: float) -> str:
    return f"{value:g}x"


def log_scale(ax, which: str, text: Callable[[float], str]) -> None:
    """A log scale on the x or y axis (`which`), its ticks labelled by `text`."""
    (ax.set_xscale if which == "x" else ax.set_yscale)("log")
    axis = ax.xaxis if which == "x" else ax.yaxis
    axis.set_major_formatter(_LogTicks(text))
    axis.set_minor_formatter(_LogTicks(text))

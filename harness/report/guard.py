"""A fault while building one section or drawing one plot costs only that section or plot.

The report reads folders it did not write: rows of older schemas, of other machines, of runs that went
wrong in ways no one listed. Every degenerate case known is handled where it arises, with a line saying
what could not be shown and why (tests/test_report_degenerate.py lists them); these two wrappers are for
the rest, so that one bad group never costs the other sections theirs. The line they leave names the
fault (its type and first line), never a traceback.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

from harness.config.validate import first_line
from harness.report.document import Block, Heading, Paragraph
from harness.report.figures import discard_open

NOT_DRAWN = "could not be drawn"  # in every line a fault leaves, so a reader (and a test) can find them


def section(heading: str, build: Callable[[], list[Block]], level: int = 2) -> list[Block]:
    """build()'s blocks, or the section's heading and one line naming the fault that stopped it."""
    try:
        return build()
    except Exception as error:  # noqa: BLE001 - whatever went wrong, the other sections are still built
        discard_open()
        return [Heading(heading, level), Paragraph(f"*(this section {NOT_DRAWN}: {first_line(error)})*")]


def plot(draw: Callable[[], Optional[Path]]) -> tuple[Optional[Path], Optional[str]]:
    """(the PNG draw() wrote or None, None), or (None, a line naming the fault that stopped it)."""
    try:
        return draw(), None
    except Exception as error:  # noqa: BLE001 - the section's other plots and tables are still drawn
        discard_open()
        return None, f"*(this plot {NOT_DRAWN}: {first_line(error)})*"

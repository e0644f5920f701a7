"""The report's sections built in order, those that draw plots in a forked process for a large folder.

Once the rows are read, each section reads the same table and cohorts, draws its plots into the output
folder and returns its blocks; none depends on another's work. All of it runs on one CPU, and over
thousands of rows the plotting sections (matplotlib's layout and PNG encoding, a step ratio per point)
take about as long as the summary and the tables. So for a folder of at least APART_MIN_ROWS rows the
plotting sections are built in one forked worker, which sends their blocks back pickled, while this
process builds the others; the blocks are put back in the sections' own order, and each section is
built by guard.section wherever it runs, so a fault still costs only that section. A smaller folder,
or a platform without a safe fork, builds every section here.
"""
from __future__ import annotations

import sys
import time
from typing import Callable

from harness.files.workers import Forked, WorkerLost, patience
from harness.report import guard
from harness.report.document import Block

# Rows from which the plotting sections are built in a forked process. Below it their plots take well
# under a second, and forking this process (its table, matplotlib) would cost a share of that.
APART_MIN_ROWS = 1000

Section = tuple[str, Callable[[], list[Block]], bool]  # (heading, build, whether it draws plots)


def built(sections: list[Section], rows: int) -> list[Block]:
    """Every section's blocks, in the sections' order (guard.section: a fault leaves a line, not a gap)."""
    drawing = [i for i, (_, _, draws) in enumerate(sections) if draws]
    if rows < APART_MIN_ROWS or not drawing or not sys.platform.startswith("linux"):  # see row_files._processes
        return [block for heading, build, _ in sections for block in guard.section(heading, build)]
    # The worker ends with this process, and the wait on it is bounded (harness.files.workers): a report
    # killed or interrupted while it plots leaves no process behind.
    with Forked(_build, [sections[i] for i in drawing]) as worker:
        started = time.monotonic()
        blocks = {i: guard.section(heading, build) for i, (heading, build, _) in enumerate(sections) if i not in drawing}
        try:
            blocks.update(zip(drawing, worker.result(patience(time.monotonic() - started))))
        except WorkerLost:  # killed (out of memory) or stuck: its sections built here
            blocks.update((i, guard.section(*sections[i][:2])) for i in drawing)
    return [block for i in range(len(sections)) for block in blocks[i]]


def _build(sections: list[Section]) -> list[list[Block]]:
    """In the worker: each section's blocks."""
    return [guard.section(heading, build) for heading, build, _ in sections]

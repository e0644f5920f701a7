"""The report as a list of blocks, rendered once to Markdown (here) and once to HTML (html.py).

Sections build blocks, not text, so the two outputs never drift apart. Inline markup inside text is
limited to `code` and **bold**, which both renderers understand.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Union


@dataclass
class Heading:
    text: str  # heading text
    level: int = 2  # 1 = title, 2 = section, 3 = subsection


@dataclass
class Paragraph:
    text: str  # one paragraph; `code` and **bold** allowed


@dataclass
class Bullets:
    items: list[str]  # one line each; `code` and **bold** allowed


@dataclass
class Table:
    header: list[str]  # column titles
    rows: list[list[str]]  # cells already formatted as text
    align_right: list[bool] = field(default_factory=list)  # per column: numbers align right


@dataclass
class Figure:
    path: Path  # the PNG, written next to report.md
    caption: str  # what to look at in it


Block = Union[Heading, Paragraph, Bullets, Table, Figure]


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def to_markdown(blocks: list[Block]) -> str:
    out: list[str] = []
    for block in blocks:
        if isinstance(block, Heading):
            out.append(f"{'#' * block.level} {block.text}")
        elif isinstance(block, Paragraph):
            out.append(block.text)
        elif isinstance(block, Bullets):
            out.append("\n".join(f"- {item}" for item in block.items))
        elif isinstance(block, Table):
            right = block.align_right or [False] * len(block.header)
            lines = ["| " + " | ".join(_cell(h) for h in block.header) + " |",
                     "|" + "|".join("---:" if r else ":---" for r in right) + "|"]
            lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in block.rows]
            out.append("\n".join(lines))
        elif isinstance(block, Figure):
            out.append(f"![{block.caption}]({block.path.name})\n\n*{block.caption}*")
    return "\n\n".join(out) + "\n"

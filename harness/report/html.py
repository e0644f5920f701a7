"""Render report blocks as one self-contained HTML page: CSS inline, plots embedded as base64 PNGs."""
from __future__ import annotations

import base64
import html
import re

from harness.report.document import Block, Bullets, Figure, Heading, Paragraph, Table

STYLE = """
body { font-family: -apple-system, 'Segoe UI', Helvetica, Arial, sans-serif; margin: 2em auto;
       max-width: 1150px; padding: 0 1em; color: #1d1d1f; line-height: 1.45; }
h1 { border-bottom: 2px solid #333; padding-bottom: .2em; }
h2 { border-bottom: 1px solid #ccc; padding-bottom: .15em; margin-top: 2em; }
code { background: #f2f2f2; padding: 0 .25em; border-radius: 3px; font-size: 92%; }
table { border-collapse: collapse; margin: 1em 0; font-size: 13px; }
th, td { border: 1px solid #d0d0d0; padding: 3px 7px; }
th { background: #f4f4f4; }
td.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
tr:nth-child(even) td { background: #fafafa; }
figure { margin: 1.5em 0; }
figure img { max-width: 100%; border: 1px solid #e4e4e4; }
figcaption { color: #555; font-size: 14px; }
"""


def _inline(text: str) -> str:
    """Escape, then turn `code` and **bold** into tags."""
    escaped = html.escape(text)
    escaped = re.sub(r"`([^`]+)`", r"<code>\1</code>", escaped)
    return re.sub(r"\*\*([^*]+)\*\*", r"<strong>\1</strong>", escaped)


def _table(block: Table) -> str:
    right = block.align_right or [False] * len(block.header)
    head = "".join(f"<th>{_inline(h)}</th>" for h in block.header)
    body = []
    for row in block.rows:
        cells = "".join(
            f'<td class="num">{_inline(str(c))}</td>' if r else f"<td>{_inline(str(c))}</td>"
            for c, r in zip(row, right)
        )
        body.append(f"<tr>{cells}</tr>")
    return f'<table><thead><tr>{head}</tr></thead><tbody>{"".join(body)}</tbody></table>'


def _figure(block: Figure) -> str:
    data = base64.b64encode(block.path.read_bytes()).decode("ascii")
    caption = _inline(block.caption)
    return (f'<figure><img alt="{html.escape(block.caption)}" src="data:image/png;base64,{data}">'
            f"<figcaption>{caption}</figcaption></figure>")


def to_html(blocks: list[Block], title: str) -> str:
    parts = []
    for block in blocks:
        if isinstance(block, Heading):
            parts.append(f"<h{block.level}>{_inline(block.text)}</h{block.level}>")
        elif isinstance(block, Paragraph):
            parts.append(f"<p>{_inline(block.text)}</p>")
        elif isinstance(block, Bullets):
            parts.append("<ul>" + "".join(f"<li>{_inline(i)}</li>" for i in block.items) + "</ul>")
        elif isinstance(block, Table):
            parts.append(_table(block))
        elif isinstance(block, Figure):
            parts.append(_figure(block))
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
            f"<style>{STYLE}</style></head>\n<body>\n" + "\n".join(parts) + "\n</body></html>\n")

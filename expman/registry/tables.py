"""Plain-text and Markdown tables for CLI results on stdout; the first row is the header."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["markdown_table", "text_table"]


def text_table(rows: Sequence[Sequence[str]]) -> list[str]:
    """Columns padded to their widest cell, two spaces apart."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() for row in rows]


def markdown_table(rows: Sequence[Sequence[str]]) -> list[str]:
    """A GitHub-flavoured Markdown table."""
    header, *body = rows
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return lines + ["| " + " | ".join(row) + " |" for row in body]

"""Greedy word wrapping and indentation."""

from __future__ import annotations


def wrap(text: str, width: int) -> list[str]:
    """Split ``text`` into lines of at most ``width`` characters, breaking at whitespace.

    A word longer than ``width`` stays whole, on a line of its own. Runs of whitespace count as one
    space. An empty or blank text has no lines.
    """
    if width < 1:
        raise ValueError(f"width must be >= 1, got {width}")
    lines: list[str] = []
    line = ""
    for word in text.split():
        if not line:
            line = word
        elif len(line) + 1 + len(word) <= width:
            line += " " + word
        else:
            lines.append(line)
            line = word
    if line:
        lines.append(line)
    return lines


def indent(text: str, prefix: str, first: str | None = None) -> str:
    """Prefix every non-blank line of ``text`` with ``prefix`` (the first line with ``first`` if given).

    Blank lines (empty or whitespace only) are left as they are.
    """
    out = []
    for i, line in enumerate(text.split("\n")):
        p = first if i == 0 and first is not None else prefix
        out.append(p + line if line.strip() else line)
    return "\n".join(out)

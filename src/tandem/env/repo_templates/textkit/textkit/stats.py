"""Word statistics."""

from __future__ import annotations

import re

_TOKEN = re.compile(r"[a-z0-9']+")


def tokens(text: str) -> list[str]:
    """Lowercase words of ``text`` (letters, digits, apostrophes); quotes around a word are not part of it."""
    out = []
    for t in _TOKEN.findall(text.lower()):
        t = t.strip("'")
        if t:
            out.append(t)
    return out


def word_count(text: str) -> int:
    """Number of words in ``text``."""
    return len(tokens(text))


def top_words(text: str, n: int) -> list[tuple[str, int]]:
    """The ``n`` most frequent words with their counts, most frequent first, ties in alphabetical order."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    counts: dict[str, int] = {}
    for t in tokens(text):
        counts[t] = counts.get(t, 0) + 1
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    return ranked[:n]

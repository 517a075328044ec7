"""URL slugs."""

from __future__ import annotations

import re
import unicodedata


def slugify(s: str, max_len: int | None = None) -> str:
    """Lowercase ASCII words of ``s`` joined by single dashes, at most ``max_len`` characters long.

    Accents are stripped (``"Café"`` -> ``"cafe"``); every run of other characters becomes one dash, and a
    slug never starts or ends with a dash. ``max_len`` cuts at a word boundary: the slug keeps the words that
    fit (a first word longer than ``max_len`` is cut).
    """
    ascii_text = unicodedata.normalize("NFKD", s).encode("ascii", "ignore").decode()
    slug = re.sub(r"[^a-z0-9]+", "-", ascii_text.lower()).strip("-")
    if max_len is not None and len(slug) > max_len:
        cut = slug[: max_len + 1]
        slug = cut[: cut.rfind("-")] if "-" in cut else slug[:max_len]
    return slug

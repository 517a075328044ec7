"""Money amounts as integer cents: parsing and formatting."""

from __future__ import annotations


def parse_amount(text: str) -> int:
    """``"12.30"`` -> 1230, ``"-0.05"`` -> -5, ``"7"`` -> 700, ``"1,234.5"`` -> 123450.

    Thousands separators are allowed; at most two decimal places. ValueError for anything else.
    """
    s = text.strip().replace(",", "")
    sign = -1 if s.startswith("-") else 1
    s = s[1:] if s[:1] in "+-" else s
    whole, dot, frac = s.partition(".")
    if not whole.isdigit() or len(frac) > 2 or (dot and not frac.isdigit()):
        raise ValueError(f"not an amount: {text!r}; expected e.g. 12.30")
    return sign * (int(whole) * 100 + int(frac.ljust(2, "0")))


def format_amount(cents: int) -> str:
    """1230 -> ``"12.30"``, -5 -> ``"-0.05"``, 123456 -> ``"1,234.56"``."""
    sign = "-" if cents < 0 else ""
    whole, frac = divmod(abs(cents), 100)
    return f"{sign}{whole:,}.{frac:02d}"

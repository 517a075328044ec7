"""Times of day as minutes since midnight, and free slots in a day."""

from __future__ import annotations

from intervals.interval import Interval
from intervals.merge import gaps

MINUTES_PER_DAY = 24 * 60


def parse_hhmm(text: str) -> int:
    """``"09:30"`` -> 570. Hours 0-23 and minutes 00-59; ValueError for anything else."""
    hh, sep, mm = text.strip().partition(":")
    if not sep or not hh.isdigit() or not mm.isdigit() or len(mm) != 2:
        raise ValueError(f"not a time of day: {text!r}; expected HH:MM")
    h, m = int(hh), int(mm)
    if not (0 <= h < 24 and 0 <= m < 60):
        raise ValueError(f"not a time of day: {text!r}; hours are 0-23, minutes 0-59")
    return h * 60 + m


def format_hhmm(minutes: int) -> str:
    """570 -> ``"09:30"``; times past midnight wrap around to the next day."""
    h, m = divmod(minutes % MINUTES_PER_DAY, 60)
    return f"{h:02d}:{m:02d}"


def free_slots(
    busy: list[tuple[str, str]], day: tuple[str, str], min_minutes: int = 0
) -> list[tuple[str, str]]:
    """Free ``(start, end)`` times of ``day`` outside the ``busy`` meetings, each at least ``min_minutes``."""
    window = Interval(parse_hhmm(day[0]), parse_hhmm(day[1]))
    meetings = [Interval(parse_hhmm(a), parse_hhmm(b)) for a, b in busy]
    return [
        (format_hhmm(g.start), format_hhmm(g.end)) for g in gaps(meetings, window) if g.length >= min_minutes
    ]

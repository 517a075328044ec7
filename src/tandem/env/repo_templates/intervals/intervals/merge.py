"""Unions, total lengths and gaps of sets of intervals."""

from __future__ import annotations

from intervals.interval import Interval


def merge(intervals: list[Interval]) -> list[Interval]:
    """The union of ``intervals`` as sorted, disjoint intervals; touching intervals are joined."""
    out: list[Interval] = []
    for iv in sorted(intervals):
        if out and iv.start <= out[-1].end:
            if iv.end > out[-1].end:
                out[-1] = Interval(out[-1].start, iv.end)
        else:
            out.append(iv)
    return out


def total_length(intervals: list[Interval]) -> int:
    """How many points are covered by at least one of ``intervals``."""
    return sum(iv.length for iv in merge(intervals))


def gaps(intervals: list[Interval], within: Interval) -> list[Interval]:
    """The parts of ``within`` that no interval covers, in order."""
    out: list[Interval] = []
    cursor = within.start
    for iv in merge(intervals):
        if iv.end <= cursor:
            continue
        if iv.start >= within.end:
            break
        if iv.start > cursor:
            out.append(Interval(cursor, iv.start))
        cursor = iv.end
    if cursor < within.end:
        out.append(Interval(cursor, within.end))
    return out

"""Half-open intervals ``[start, end)`` of integers (minutes, days, offsets)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, order=True)
class Interval:
    """The integers ``start <= x < end``; an empty interval has ``start == end``."""

    start: int
    end: int

    def __post_init__(self) -> None:
        if self.end < self.start:
            raise ValueError(f"interval end {self.end} is before its start {self.start}")

    @property
    def length(self) -> int:
        return self.end - self.start

    def contains(self, point: int) -> bool:
        """Whether ``point`` is in the interval (``end`` itself is not)."""
        return self.start <= point < self.end

    def overlaps(self, other: Interval) -> bool:
        """Whether the intervals share at least one point; touching intervals do not overlap."""
        return self.start < other.end and other.start < self.end

    def intersection(self, other: Interval) -> Interval | None:
        """The common part, or None when the intervals do not overlap."""
        if not self.overlaps(other):
            return None
        return Interval(max(self.start, other.start), min(self.end, other.end))

    def as_tuple(self) -> tuple[int, int]:
        return (self.start, self.end)

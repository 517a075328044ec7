"""intervals: half-open integer intervals, merging, and free slots in a day."""

from intervals.clock import format_hhmm, free_slots, parse_hhmm
from intervals.interval import Interval
from intervals.merge import gaps, merge, total_length

__all__ = ["Interval", "format_hhmm", "free_slots", "gaps", "merge", "parse_hhmm", "total_length"]

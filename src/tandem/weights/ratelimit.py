"""A thread-safe token bucket that paces bytes, for simulating slow links in benchmarks and tests.

Invariant: one bucket is one link. Every caller sharing a bucket shares its rate, so ``n`` bytes through a
bucket take at least ``(n - burst) / rate`` seconds of wall time in total, however many threads send them.
``consume`` never returns early unless ``stop`` is set, and the bucket keeps exact accounting (``bytes``,
``waited_s``) that tests can check instead of timing the transfer.
"""

from __future__ import annotations

import math
import threading
import time

DEFAULT_BURST_BYTES = 64 * 1024


class TokenBucket:
    def __init__(self, rate_bytes_per_s: float, burst_bytes: int | None = None) -> None:
        if not (math.isfinite(rate_bytes_per_s) and rate_bytes_per_s > 0):
            raise ValueError(f"bandwidth must be > 0 and finite (bytes/s), got {rate_bytes_per_s}")
        self.rate = float(rate_bytes_per_s)
        self.burst = int(burst_bytes if burst_bytes is not None else max(DEFAULT_BURST_BYTES, self.rate / 20))
        self._mutex = threading.Lock()
        self._free_at = time.monotonic() - self.burst / self.rate
        self.bytes = 0
        self.waited_s = 0.0

    def consume(self, n: int, stop: threading.Event | None = None) -> float:
        """Account ``n`` bytes and sleep until the link would have carried them; return the delay."""
        if n <= 0:
            return 0.0
        with self._mutex:
            now = time.monotonic()
            # Idle time refills the bucket, but never beyond the burst.
            self._free_at = max(self._free_at, now - self.burst / self.rate) + n / self.rate
            delay = self._free_at - now
            self.bytes += n
        if delay <= 0:
            return 0.0
        if stop is not None:
            stop.wait(delay)
        else:
            time.sleep(delay)
        with self._mutex:
            self.waited_s += delay
        return delay

    def min_duration_s(self, nbytes: int) -> float:
        """The least wall time ``nbytes`` can take through this bucket starting full."""
        return max(0.0, (nbytes - self.burst) / self.rate)


def mbps_to_bytes_per_s(mbps: float) -> float:
    """Megabits per second (network units, 10**6 bits) to bytes per second."""
    return mbps * 1e6 / 8

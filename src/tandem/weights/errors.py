"""Errors of the weight store and its transport.

Invariant: every message names the value that was wrong (version, blob key, store location, URL) and says
what to do. All derive from ``WeightStoreError`` (a ``TandemError``) so a long-running service can catch
one type, answer with an error response and keep running.
"""

from __future__ import annotations

from tandem.core.errors import TandemError


class WeightStoreError(TandemError):
    """Base class of weight store and transport errors."""


class NotAStoreError(WeightStoreError):
    """The location exists but holds no weight store (no ``store.json``), or does not exist."""


class MissingKeyError(WeightStoreError, KeyError):
    """A backend key does not exist (raised by backends; the store turns it into a more specific error)."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class VersionNotFoundError(WeightStoreError, LookupError):
    """A version has no manifest in the store (never published, not yet published, or garbage-collected)."""


class ManifestError(WeightStoreError):
    """A manifest is malformed, or a publish request would produce an invalid one."""


class MissingBlobError(WeightStoreError, LookupError):
    """A blob referenced by a manifest is absent from every source."""


class CorruptBlobError(WeightStoreError, ValueError):
    """A blob's bytes do not hash to its content address (corrupted or truncated)."""

    def __init__(self, key: str, actual: str, size: int, where: str = "") -> None:
        self.key, self.actual, self.size = key, actual, size
        at = f" at {where}" if where else ""
        super().__init__(
            f"blob {key[:16]}{at} is corrupt or truncated: {size} bytes hash to {actual[:16]}; "
            "it was not used; refetch it or fall back to the nearest full snapshot"
        )


class StoreLockedError(WeightStoreError):
    """Another publisher holds the store's single-writer lock."""


class TransportError(WeightStoreError):
    """Every HTTP source failed for a request (after retries)."""

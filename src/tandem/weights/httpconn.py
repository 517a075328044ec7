"""Weight-server URLs and a small keep-alive connection pool over ``http.client`` (thread-safe).

Invariants: a URL is accepted only as ``http(s)://HOST[:PORT][/base]`` (``TransportError`` names it
otherwise); a connection goes back to the pool only after its last response was read to the end, so a
pooled connection never carries leftover bytes; a request on a reused connection that the server had
already closed is retried once on a fresh connection (that is not a source failure).
"""

from __future__ import annotations

import http.client
import threading
from dataclasses import dataclass
from urllib.parse import urlsplit

from tandem.weights.errors import TransportError


@dataclass
class Source:
    """One server or relay the client may ask; ``penalized_until`` moves a failing source to the back."""

    url: str
    scheme: str
    host: str
    port: int
    base: str
    penalized_until: float = 0.0


def parse_source(url: str) -> Source:
    """Validate a server URL (``http://host:port[/base]``); raise ``TransportError`` naming it."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as e:
        raise TransportError(f"bad weight server URL {url!r}: {e}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise TransportError(f"bad weight server URL {url!r}: expected http://HOST:PORT")
    default = 443 if parts.scheme == "https" else 80
    return Source(url, parts.scheme, parts.hostname, port or default, parts.path.rstrip("/"))


class ConnectionPool:
    def __init__(self, timeout_s: float, max_idle_per_source: int) -> None:
        self.timeout_s = timeout_s
        self.max_idle = max_idle_per_source
        self._idle: dict[str, list[http.client.HTTPConnection]] = {}
        self._closed = False
        self._mutex = threading.Lock()

    def checkout(self, src: Source) -> tuple[http.client.HTTPConnection, bool]:
        """An idle connection to ``src`` (reused=True) or a new one."""
        with self._mutex:
            idle = self._idle.get(src.url)
            if idle:
                return idle.pop(), True
        cls = http.client.HTTPSConnection if src.scheme == "https" else http.client.HTTPConnection
        return cls(src.host, src.port, timeout=self.timeout_s), False

    def checkin(self, src: Source, conn: http.client.HTTPConnection) -> None:
        """Keep a connection whose last response was read to the end, for reuse."""
        with self._mutex:
            idle = self._idle.setdefault(src.url, [])
            if not self._closed and len(idle) < self.max_idle:
                idle.append(conn)
                return
        conn.close()

    def drain(self, src: Source) -> None:
        """Close the idle connections to a source that just failed (they may be dead too)."""
        with self._mutex:
            idle = self._idle.pop(src.url, [])
        for conn in idle:
            conn.close()

    def open(
        self, src: Source, method: str, path: str, headers: dict[str, str] | None = None
    ) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
        """Send a request and return the connection and its response (headers read, body not)."""
        while True:
            conn, reused = self.checkout(src)
            try:
                conn.request(method, src.base + path, headers=headers or {})
                return conn, conn.getresponse()
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
                conn.close()
                if not reused:  # a fresh connection failed: the source is down
                    raise
            except BaseException:
                conn.close()
                raise

    def close(self) -> None:
        with self._mutex:
            self._closed = True
            idle, self._idle = self._idle, {}
        for conns in idle.values():
            for conn in conns:
                conn.close()

"""HTTP transport of a weight store: the server (``serve_store``), shared with relays, and its routes.

Routes (GET and HEAD):
- ``/v1/weights/latest`` -> ``{"version": int | null}``
- ``/v1/weights/manifests/{version}`` -> the manifest JSON exactly as stored (404 names the version; 400 for
  a version that is not 1-19 ASCII digits)
- ``/v1/weights/blobs/{sha256}`` -> the blob's bytes; ``Range: bytes=a-b`` / ``a-`` / ``-n`` answers 206 with
  ``Content-Range``, a valid but unsatisfiable range 416; an invalid Range header (RFC 9110: bad syntax,
  non-ASCII digits, last < first) and multi-range requests get the whole blob (200)
- ``/v1/weights/stats`` -> the server's counters (requests, blob GETs per key, bytes sent) and, under
  ``limits``, its connection cap and send bounds

Invariants: a blob is sent only after its bytes were checked against its address (once per process per
blob; a corrupt blob is answered 502 and never sent); a bad request gets an error status and a JSON
``{"error": ...}`` body and the server keeps running; a request that declares a body (no route reads one)
is answered and its connection closed, so the body is never parsed as a request; ``close()`` stops
accepting, aborts transfers in flight (clients see a short read and resume elsewhere) and returns promptly.
The optional bandwidth limit is one token bucket for the whole server (all connections share it, like one
uplink).

Connections: one thread each, at most ``max_connections`` at once (default from the process's open-file
limit, ``default_max_connections``, so sockets never exhaust the descriptors the server needs to accept and
to read blobs). A connection is *idle* while it waits for a request or its request's headers are still
arriving; a new connection beyond the cap closes the longest-idle one (its client, if well-behaved, retries
on a fresh connection), or else one stalled on its client (below), and is refused (closed at once,
``refused_connections``) only when every connection is busy and none is stalled. So idle or slowloris
connections, however many, never keep a well-behaved client out, and an ``accept`` that fails for lack of
descriptors frees an idle or stalled one and backs off instead of spinning. Eviction and ``close`` shut
down only tracked sockets, under the connections' mutex, and a handler untracks its socket under that mutex
before closing it, so neither ever acts on a socket being closed (whose descriptor the next accept may
reuse).

Sending (every byte of a response: headers, JSON, manifests, blobs) waits on the client only within two
bounds, so a client that asks for a large blob and then reads it slowly or not at all never holds its
connection, and its thread, for long. What counts is what the client's TCP stack acknowledges (``SIOCOUTQ``
on Linux), looked at every half second while a send waits; the server's own bandwidth limit and blob reads
do not count as waiting. A response whose client accepts no byte for ``send_stall_s`` (default 30 s) is
dropped, and so is one whose client accepts bytes below ``min_send_rate`` (default 16 KiB/s; 0: no floor):
a response may wait on its client at most ``send_stall_s + accepted / min_send_rate`` seconds in all, so the
floor never drops a client at or above it. A dropped response's connection is reset (``SO_LINGER`` 0:
what is queued for it is discarded) and counted (``dropped_stalled_responses``,
``dropped_slow_responses``); its client sees a short read and can resume with ``Range``. And when the
server is full with no idle connection, a new connection closes the response that has waited longest on
a client that accepts nothing, once that is ``EVICT_STALLED_S`` (2 s, or ``send_stall_s`` if less;
``evicted_stalled_connections``), instead of being refused. So clients that stop reading, however many,
keep a well-behaved client out for seconds at most, and a sender thread never waits on a client that
accepts nothing for longer than ``send_stall_s``.
"""

from __future__ import annotations

import errno
import fcntl
import io
import json
import logging
import math
import resource
import socket
import struct
import termios
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Protocol
from urllib.parse import urlsplit

from tandem.weights.client import WeightClient
from tandem.weights.errors import (
    CorruptBlobError,
    MissingBlobError,
    TransportError,
    VersionNotFoundError,
    WeightStoreError,
)
from tandem.weights.manifest import is_sha256
from tandem.weights.ratelimit import TokenBucket
from tandem.weights.store import WeightStore

__all__ = ["BlobReader", "BlobSource", "WeightClient", "WeightServer", "serve_store"]

log = logging.getLogger(__name__)
PREFIX = "/v1/weights"
READ_CHUNK = 1 << 20
CORRUPT_HEADER = "X-Tandem-Error"
SEND_CHUNK = 64 * 1024


@dataclass
class BlobReader:
    """A verified blob: its size and a reader of bytes ``[start, end)``."""

    size: int
    read: Callable[[int, int], bytes]


class BlobSource(Protocol):
    def latest(self) -> int | None: ...

    def manifest_bytes(self, version: int) -> bytes: ...

    def open_blob(self, key: str) -> BlobReader: ...


class StoreSource:
    """Serves a ``WeightStore`` directly."""

    def __init__(self, store: WeightStore) -> None:
        self.store = store

    def latest(self) -> int | None:
        return self.store.latest()

    def manifest_bytes(self, version: int) -> bytes:
        return self.store.manifest_bytes(version)

    def open_blob(self, key: str) -> BlobReader:
        size = self.store.verify_blob(key)
        return BlobReader(size, lambda start, end: self.store.blob_range(key, start, end))


class ServerStats:
    """Thread-safe counters of one server."""

    def __init__(self) -> None:
        self._mutex = threading.Lock()
        self.counts: Counter[str] = Counter()
        self.blob_gets: Counter[str] = Counter()

    def add(self, name: str, n: int = 1) -> None:
        with self._mutex:
            self.counts[name] += n

    def blob_get(self, key: str) -> None:
        with self._mutex:
            self.blob_gets[key] += 1
            self.counts["blob_gets"] += 1

    def stream(self, delta: int) -> None:
        """Track blob responses in flight and the most seen at once (``max_concurrent_streams``)."""
        with self._mutex:
            self.counts["streams_in_flight"] += delta
            peak = max(self.counts["max_concurrent_streams"], self.counts["streams_in_flight"])
            self.counts["max_concurrent_streams"] = peak

    def snapshot(self) -> dict[str, Any]:
        with self._mutex:
            return {**self.counts, "blob_gets_by_key": dict(self.blob_gets)}


class _Unsatisfiable(Exception):
    pass


MAX_DIGITS = 19  # more significant digits than any version or blob size can have


def ascii_int(text: str) -> int | None:
    """``text`` as a non-negative integer if it is 1 or more ASCII digits, else None (``str.isdigit`` alone
    accepts e.g. superscripts, which ``int`` refuses). More than ``MAX_DIGITS`` significant digits read as
    ``10**MAX_DIGITS`` (beyond any blob), so ``int`` never parses thousands of digits."""
    if not text or not (text.isascii() and text.isdigit()):
        return None
    digits = text.lstrip("0") or "0"
    return int(digits) if len(digits) <= MAX_DIGITS else 10**MAX_DIGITS


def parse_range(header: str | None, size: int) -> tuple[int, int] | None:
    """``[start, end)`` of a single-range header, None for "whole blob"; raises ``_Unsatisfiable``.

    As RFC 9110 (14.2) says, a Range header that is not a valid single byte range (unknown unit, no ``-``,
    non-digits, last < first, several ranges) is ignored: the whole blob is sent (200). Only a valid range
    that selects no byte of the blob is unsatisfiable (416)."""
    if not header or not header.startswith("bytes=") or "," in header:
        return None
    first, sep, last = header[6:].strip().partition("-")
    start, stop = ascii_int(first), ascii_int(last)
    if not sep or (first and start is None) or (last and stop is None) or (start is None and stop is None):
        return None
    if start is None:  # suffix: the last n bytes
        assert stop is not None
        if stop == 0 or size == 0:
            raise _Unsatisfiable
        return max(0, size - stop), size
    if stop is not None and stop < start:
        return None  # invalid, not unsatisfiable
    if start >= size:
        raise _Unsatisfiable
    return start, size if stop is None else min(size, stop + 1)


FD_RESERVE = 64
"""Descriptors kept free of connections: the listening socket, log files, blob reads, a store's clients."""
MAX_CONNECTIONS = 1024
"""Upper bound of the default cap (one thread per connection)."""
_ACCEPT_BACKOFF_S = 0.05
DEFAULT_SEND_STALL_S = 30.0
"""A response whose client accepts no byte for this long is dropped."""
DEFAULT_MIN_SEND_RATE = 16 * 1024
"""Bytes/s below which a response is dropped (after ``send_stall_s`` of grace): a client this slow, about
0.13 Mbit/s, is not following weights."""
EVICT_STALLED_S = 2.0
"""On a full server, a new connection closes a response whose client has accepted nothing for this long."""
_LINGER_RESET = struct.pack("ii", 1, 0)


def default_max_connections() -> int:
    """Connections a server admits at once: half the descriptors left after ``FD_RESERVE`` (a connection
    may hold a socket and a blob file), at least 4 and at most ``MAX_CONNECTIONS``."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return MAX_CONNECTIONS
    return max(4, min(MAX_CONNECTIONS, (soft - FD_RESERVE) // 2))


class _Conn:
    """One admitted connection: since when it is idle (None while busy) and its current response's send
    progress. Written by its handler thread; read by the accepting thread under the server's mutex."""

    __slots__ = ("accepted", "idle_since", "response_from", "waited", "waiting_since", "written")

    def __init__(self, now: float) -> None:
        self.idle_since: float | None = now
        self.written = 0
        """Bytes written into the socket on this connection."""
        self.response_from = 0
        """``written`` when the current response began."""
        self.waited = 0.0
        """Seconds the current response has spent in ``send``, waiting on its client."""
        self.accepted = 0
        """Bytes of the current response its client has acknowledged, when last looked."""
        self.waiting_since: float | None = None
        """While a write is in progress: when its client last accepted bytes (or the write began)."""

    def start_response(self) -> None:
        self.response_from, self.waited, self.accepted = self.written, 0.0, 0


class _SendDeadline(TimeoutError):
    """A response dropped because its client stopped accepting bytes or accepts them below the floor rate
    (a ``TimeoutError``, so ``http.server``'s own request loop also treats it as a closed connection)."""


def _reset_on_close(sock: socket.socket) -> None:
    """Make closing ``sock`` send a reset and discard what is queued for its client."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RESET)
    except OSError:
        pass


_OUTQ = getattr(termios, "TIOCOUTQ", None)
"""Linux's ``SIOCOUTQ`` (same number): the bytes of a TCP socket its peer has not acknowledged yet."""
_POLL_S = 0.5
"""How often a waiting send looks at what its client has acknowledged."""


class _DeadlineWriter(io.BufferedIOBase):
    """A connection's ``wfile``: sends every byte within the server's send bounds (module docstring) and
    raises ``_SendDeadline`` past them.

    Progress is what the client's TCP stack acknowledged (``SIOCOUTQ``), looked at after each ``send`` and
    every ``_POLL_S`` while one waits, not bytes handed to the kernel: those fill the send buffer (megabytes,
    autotuned) at once for a client that reads nothing, and the socket turns writable again only after
    about a third of it drained. A client reading slowly out of a large receive buffer it filled earlier
    acknowledges nothing until about half of it is free again (TCP's window updates), so one that slows to
    a crawl after a fast start can meet the stall bound; it resumes with ``Range``. Where the query is not
    available, bytes written count as accepted."""

    def __init__(self, sock: socket.socket, conn: _Conn, owner: WeightServer, read_timeout: float | None):
        self._sock, self._conn, self._owner, self._read_timeout = sock, conn, owner, read_timeout

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        sock, conn = self._sock, self._conn
        stall_s, floor = self._owner.send_stall_s, self._owner.min_send_rate
        pos, size = 0, len(view)
        t0 = conn.waiting_since = time.monotonic()
        sock.settimeout(min(_POLL_S, stall_s / 4))
        try:
            try:  # the common case: the socket takes it all at once, nothing waited on the client
                pos = sock.send(view)
            except TimeoutError:
                pass
            conn.written += pos
            if pos < size:
                conn.waited += time.monotonic() - t0
            while pos < size:
                t0 = time.monotonic()
                try:
                    n = sock.send(view[pos:])
                except TimeoutError:
                    n = 0
                now = time.monotonic()
                conn.waited += now - t0
                pos += n
                conn.written += n
                accepted = self._accepted()
                if accepted > conn.accepted:
                    conn.accepted, conn.waiting_since = accepted, now
                elif now - conn.waiting_since >= stall_s:
                    self._drop("dropped_stalled_responses", f"accepted no byte for {stall_s:g} s")
                if floor and conn.waited > stall_s + conn.accepted / floor:
                    self._drop("dropped_slow_responses", f"accepts bytes below {floor:.0f} B/s")
        finally:
            conn.waiting_since = None
            sock.settimeout(self._read_timeout)
        return size

    def _accepted(self) -> int:
        """Bytes of the current response the client has acknowledged."""
        conn, queued = self._conn, 0
        if _OUTQ is not None:
            try:
                queued = struct.unpack("i", fcntl.ioctl(self._sock.fileno(), _OUTQ, b"\0\0\0\0"))[0]
            except OSError:
                pass
        return conn.written - queued - conn.response_from

    def _drop(self, counter: str, why: str) -> None:
        _reset_on_close(self._sock)
        self._owner.stats.add(counter)
        log.info("weights server: dropped a response whose client %s", why)
        raise _SendDeadline(f"client {why}")


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128
    owner: WeightServer

    def get_request(self) -> tuple[socket.socket, Any]:
        try:
            return super().get_request()
        except OSError as e:
            if e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                # Out of descriptors: free an idle connection and back off; without this the listening
                # socket stays readable and the serve loop spins on failing accepts.
                self.owner._evict_one()
                time.sleep(_ACCEPT_BACKOFF_S)
            raise

    def verify_request(self, request: Any, client_address: Any) -> bool:
        return self.owner._admit(request)

    def process_request(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.owner._untrack(request)  # no thread was started for it
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.owner._untrack(request)

    def shutdown_request(self, request: Any) -> None:
        # Untracked first, under the owner's mutex: eviction and ``close`` shut down only tracked sockets,
        # holding that mutex, so they never act on a socket its handler is closing (whose descriptor the
        # next accept may already reuse for another client).
        self.owner._untrack(request)
        super().shutdown_request(request)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    timeout = 120
    server: _HTTPServer

    def setup(self) -> None:
        super().setup()
        # Headers and body go out in separate writes: without TCP_NODELAY, Nagle's algorithm holds the body
        # until the client's delayed ACK (about 40 ms on Linux), once per request.
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        owner = self.server.owner
        self.wfile = _DeadlineWriter(self.connection, owner._record(self.connection), owner, self.timeout)

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s " + format, self.address_string(), *args)

    def handle_one_request(self) -> None:
        self.server.owner._set_idle(self.connection, True)  # until this request's headers are in
        super().handle_one_request()

    def parse_request(self) -> bool:
        ok = super().parse_request()
        self.server.owner._set_idle(self.connection, False)
        return ok

    def do_GET(self) -> None:
        self._dispatch(head=False)

    def do_HEAD(self) -> None:
        self._dispatch(head=True)

    def _dispatch(self, head: bool) -> None:
        owner = self.server.owner
        owner.stats.add("requests")
        if self.headers.get("Transfer-Encoding") or self.headers.get("Content-Length", "0").strip() != "0":
            # No route takes a body and none is read: close after answering, so its bytes are never taken
            # for the next request on this connection (a smuggled request).
            self.close_connection = True
        path = urlsplit(self.path).path.rstrip("/")
        try:
            if path == f"{PREFIX}/latest":
                self._send_json(200, {"version": owner.source.latest()}, head)
            elif path == f"{PREFIX}/stats":
                self._send_json(200, {**owner.stats.snapshot(), "limits": owner.limits()}, head)
            elif path.startswith(f"{PREFIX}/manifests/"):
                self._manifest(path.rsplit("/", 1)[1], head)
            elif path.startswith(f"{PREFIX}/blobs/"):
                self._blob(path.rsplit("/", 1)[1], head)
            else:
                self._error(404, f"no route {self.path!r}; see /v1/weights/latest, manifests/N, blobs/SHA256")
        except (VersionNotFoundError, MissingBlobError) as e:
            self._error(404, str(e))
        except CorruptBlobError as e:
            owner.stats.add("corrupt_blobs")
            self._error(502, str(e), extra={CORRUPT_HEADER: "corrupt-blob"})
        except TransportError as e:
            self._error(502, str(e))
        except WeightStoreError as e:
            self._error(500, str(e))
        except (ConnectionError, TimeoutError, _Aborted):
            self.close_connection = True
        except Exception as e:  # a bad request never takes the server down
            log.exception("weights server: %s failed", self.path)
            self._error(500, f"internal error: {type(e).__name__}: {e}")

    def _manifest(self, text: str, head: bool) -> None:
        version = ascii_int(text)
        if version is None or len(text) > MAX_DIGITS:
            self._error(
                400,
                f"manifest version {text[:40]!r} is not a non-negative integer of up to {MAX_DIGITS} digits",
            )
            return
        body = self.server.owner.source.manifest_bytes(version)
        self._send(200, body, "application/json", head)

    def _blob(self, key: str, head: bool) -> None:
        owner = self.server.owner
        if not is_sha256(key):
            self._error(400, f"blob address {key!r} is not 64 lowercase hex digits")
            return
        reader = owner.source.open_blob(key)
        try:
            rng = parse_range(self.headers.get("Range"), reader.size)
        except _Unsatisfiable:
            self._error(
                416,
                f"range {self.headers.get('Range')!r} outside blob of {reader.size} bytes",
                extra={"Content-Range": f"bytes */{reader.size}"},
            )
            return
        start, end = rng if rng is not None else (0, reader.size)
        self.send_response(206 if rng is not None else 200)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(end - start))
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("ETag", f'"{key}"')
        if rng is not None:
            self.send_header("Content-Range", f"bytes {start}-{end - 1}/{reader.size}")
        self.end_headers()
        if head:
            return
        owner.stats.blob_get(key)
        owner.stats.stream(+1)
        try:
            self._stream(reader, start, end)
        finally:
            owner.stats.stream(-1)

    def _stream(self, reader: BlobReader, start: int, end: int) -> None:
        owner = self.server.owner
        pos = start
        while pos < end:
            try:
                chunk = reader.read(pos, min(end, pos + READ_CHUNK))
            except Exception as e:  # headers are out: the only honest signal left is a short response
                log.warning("weights server: reading blob failed mid-response: %s", e)
                raise _Aborted from e
            if not chunk:  # the blob shrank after it was verified: cut the response short
                raise _Aborted
            if owner.limiter is None:  # one write per chunk; the writer sends it in pieces as it goes
                if owner.stopping.is_set():
                    raise _Aborted
                self.wfile.write(chunk)
                owner.stats.add("bytes_sent", len(chunk))
                pos += len(chunk)
                continue
            for i in range(0, len(chunk), SEND_CHUNK):
                piece = chunk[i : i + SEND_CHUNK]
                if owner.limiter is not None:
                    owner.limiter.consume(len(piece), owner.stopping)
                if owner.stopping.is_set():
                    raise _Aborted
                self.wfile.write(piece)
                owner.stats.add("bytes_sent", len(piece))
            pos += len(chunk)

    def _send_json(self, status: int, obj: Any, head: bool) -> None:
        self._send(status, json.dumps(obj).encode(), "application/json", head)

    def _error(self, status: int, message: str, extra: dict[str, str] | None = None) -> None:
        self.server.owner.stats.add(f"status_{status}")
        self._send(
            status, json.dumps({"error": message}).encode(), "application/json", self.command == "HEAD", extra
        )

    def _send(
        self, status: int, body: bytes, ctype: str, head: bool, extra: dict[str, str] | None = None
    ) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        for name, value in (extra or {}).items():
            self.send_header(name, value)
        self.end_headers()
        if not head:
            self.wfile.write(body)


class _Aborted(Exception):
    pass


class WeightServer:
    """An HTTP server over a ``BlobSource`` in a background thread; ``url`` is where it listens."""

    def __init__(
        self,
        source: BlobSource,
        host: str = "127.0.0.1",
        port: int = 0,
        bandwidth_bytes_per_s: float | None = None,
        max_connections: int | None = None,
        send_stall_s: float = DEFAULT_SEND_STALL_S,
        min_send_rate: float = DEFAULT_MIN_SEND_RATE,
    ) -> None:
        self.source = source
        self.limiter = TokenBucket(bandwidth_bytes_per_s) if bandwidth_bytes_per_s else None
        self.stats = ServerStats()
        self.stopping = threading.Event()
        self.max_connections = default_max_connections() if max_connections is None else max_connections
        if self.max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {max_connections}")
        if not (math.isfinite(send_stall_s) and send_stall_s > 0):
            raise ValueError(f"send_stall_s must be > 0 and finite, got {send_stall_s}")
        if not (math.isfinite(min_send_rate) and min_send_rate >= 0):
            raise ValueError(
                f"min_send_rate must be >= 0 and finite (bytes/s; 0: no floor), got {min_send_rate}"
            )
        self.send_stall_s = float(send_stall_s)
        self.min_send_rate = float(min_send_rate)
        # Every admitted connection -> its record (idle or busy, send progress; see module docstring).
        self._connections: dict[socket.socket, _Conn] = {}
        self._conn_mutex = threading.Lock()
        self._httpd = _HTTPServer((host, port), _Handler)
        self._httpd.owner = self
        self.host, self.port = self._httpd.server_address[:2]
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, args=(0.05,), name=f"weights-http-{self.port}", daemon=True
        )
        self._thread.start()

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in str(self.host) else self.host
        return f"http://{host}:{self.port}"

    def limits(self) -> dict[str, float]:
        """The connection cap and send bounds this server enforces (module docstring)."""
        return {
            "max_connections": self.max_connections,
            "send_stall_s": self.send_stall_s,
            "min_send_rate": self.min_send_rate,
        }

    def _admit(self, sock: socket.socket) -> bool:
        """Track a new connection, closing the longest-idle one (or else one stalled on its client) to stay
        within ``max_connections``; False (the caller closes it) when every admitted connection is busy and
        none of them is stalled."""
        with self._conn_mutex:
            if len(self._connections) >= self.max_connections and not self._evict_one_locked():
                self.stats.add("refused_connections")
                return False
            self._connections[sock] = _Conn(time.monotonic())
            return True

    def _record(self, sock: socket.socket) -> _Conn:
        """The record of an admitted connection (a detached one if it was already evicted)."""
        with self._conn_mutex:
            return self._connections.get(sock) or _Conn(time.monotonic())

    def _evict_one(self) -> bool:
        with self._conn_mutex:
            return self._evict_one_locked()

    def _evict_one_locked(self) -> bool:
        """Close the longest-idle connection, else the one whose client has accepted nothing the longest,
        if that is at least ``EVICT_STALLED_S``; False if there is neither."""
        idle = [
            (c.idle_since, id(sock), sock)
            for sock, c in self._connections.items()
            if c.idle_since is not None
        ]
        if idle:
            self._close_tracked(min(idle)[2], reset=False)
            self.stats.add("evicted_idle_connections")
            return True
        since = time.monotonic() - min(EVICT_STALLED_S, self.send_stall_s)
        stalled = [  # ``waiting_since`` is read once: its handler thread sets it without the mutex
            (w, id(sock), sock)
            for sock, c in self._connections.items()
            if (w := c.waiting_since) is not None and w <= since
        ]
        if stalled:
            self._close_tracked(min(stalled)[2], reset=True)
            self.stats.add("evicted_stalled_connections")
            return True
        return False

    def _close_tracked(self, sock: socket.socket, reset: bool) -> None:
        del self._connections[sock]  # its thread's own untrack is then a no-op
        if reset:
            _reset_on_close(sock)
        try:
            sock.shutdown(socket.SHUT_RDWR)  # its handler's blocked read or send returns at once and it exits
        except OSError:
            pass

    def _set_idle(self, sock: socket.socket, idle: bool) -> None:
        """Mark a connection idle (keeping the time it became so, if it already was) or busy with a new
        request (whose response's send progress starts from zero)."""
        with self._conn_mutex:
            conn = self._connections.get(sock)
            if conn is None:
                return
            if idle:
                conn.idle_since = conn.idle_since or time.monotonic()
            else:
                conn.idle_since = None
                conn.start_response()

    def _untrack(self, sock: socket.socket) -> None:
        with self._conn_mutex:
            self._connections.pop(sock, None)

    def close(self) -> None:
        """Stop serving and abort every transfer in flight."""
        if self.stopping.is_set():
            return
        self.stopping.set()
        self._httpd.shutdown()
        with self._conn_mutex:  # a handler untracks its socket under it before closing it (shutdown_request)
            for sock in self._connections:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        self._httpd.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> WeightServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def serve_store(
    store: WeightStore,
    host: str = "127.0.0.1",
    port: int = 0,
    bandwidth_bytes_per_s: float | None = None,
    max_connections: int | None = None,
    send_stall_s: float = DEFAULT_SEND_STALL_S,
    min_send_rate: float = DEFAULT_MIN_SEND_RATE,
) -> WeightServer:
    """Serve ``store`` over HTTP (see the module docstring); ``bandwidth_bytes_per_s`` caps total egress;
    ``send_stall_s`` and ``min_send_rate`` bound how long a response waits on a slow client."""
    return WeightServer(
        StoreSource(store), host, port, bandwidth_bytes_per_s, max_connections, send_stall_s, min_send_rate
    )

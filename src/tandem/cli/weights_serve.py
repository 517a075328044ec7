"""`tandem weights serve` and `tandem weights relay`: the weight transport's HTTP servers, in the foreground.

Invariants: each command prints one line with the URL it serves on, then blocks until Ctrl-C (or SIGTERM) and
closes its server; both signals are handled even when the process inherited SIGINT ignored. Bad input (store
directory missing or not a store, relay cache directory that cannot be created or written, bad upstream
URL, bad port or bandwidth (not > 0 and finite), send bounds out of range, address in use) prints one
``error:`` line naming the value and exits with status 2.
"""

from __future__ import annotations

import math
import signal
import time
from pathlib import Path
from typing import Annotated, Any

import typer

from tandem.core.procs import freeze_heap, gc_freeze_enabled
from tandem.weights.errors import NotAStoreError, TransportError, WeightStoreError
from tandem.weights.httpconn import parse_source
from tandem.weights.ratelimit import mbps_to_bytes_per_s
from tandem.weights.relay import Relay
from tandem.weights.store import WeightStore
from tandem.weights.transport import DEFAULT_MIN_SEND_RATE, DEFAULT_SEND_STALL_S, serve_store

_STOP_POLL_S = 0.2
"""How often the main thread of `serve` and `relay` looks for a recorded stop signal (seconds)."""

MAX_SEND_STALL_S = 7 * 24 * 3600.0
"""The longest ``--send-stall-s`` accepted (a week)."""
SendStallOption = Annotated[
    float,
    typer.Option(
        "--send-stall-s",
        help="Drop a response whose client accepts no byte for this many seconds (slow or stuck readers).",
    ),
]
MinSendRateOption = Annotated[
    float,
    typer.Option(
        "--min-send-kib-s",
        help="Drop a response whose client reads below this many KiB/s, after --send-stall-s of grace "
        "(0: no floor).",
    ),
]


def _fail(message: str) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(2)


def _check_port(port: int) -> None:
    if not 0 <= port <= 65535:
        _fail(f"--port {port} is not a TCP port (0-65535; 0 picks a free one)")


def _bandwidth(option: str, mbps: float | None) -> float | None:
    if mbps is None:
        return None
    if not (math.isfinite(mbps_to_bytes_per_s(mbps)) and mbps > 0):
        _fail(f"{option} must be > 0 and finite (Mbit/s), got {mbps}; omit it for no limit")
    return mbps_to_bytes_per_s(mbps)


def _send_bounds(send_stall_s: float, min_send_kib_s: float) -> tuple[float, float]:
    """The server's send bounds (``send_stall_s``, ``min_send_rate`` in bytes/s), checked."""
    if not (math.isfinite(send_stall_s) and 0 < send_stall_s <= MAX_SEND_STALL_S):
        _fail(f"--send-stall-s must be > 0 and at most {MAX_SEND_STALL_S:g} (a week), got {send_stall_s}")
    if not (math.isfinite(min_send_kib_s) and min_send_kib_s >= 0):
        _fail(f"--min-send-kib-s must be >= 0 and finite (0: no floor), got {min_send_kib_s}")
    return send_stall_s, min_send_kib_s * 1024


def _block_until_interrupted(server: Any, banner: str) -> None:
    """Print ``banner`` (the line naming the URL), then serve until SIGINT or SIGTERM and close the server.
    Both are handled explicitly: a process started in the background by a non-interactive shell inherits
    SIGINT ignored, and Ctrl-C must still stop it. The handlers are installed before the banner is printed,
    so a signal sent as soon as the URL appears is never lost.

    The handler only records the signal, and the main thread looks for it every ``_STOP_POLL_S``. The kernel
    may hand a process-wide signal to one of the server's threads; Python then runs the handler only when
    the main thread next wakes, and a one-hour sleep there left a server running after Ctrl-C (6 starts in
    100 on a loaded machine). A handler that only records cannot have its exception swallowed by the code
    it interrupts either."""
    received: list[int] = []

    def _on_signal(signum: int, frame: Any) -> None:
        received.append(signum)

    previous = {sig: signal.signal(sig, _on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        typer.echo(banner)
        freeze_heap()
        while not received:
            time.sleep(_STOP_POLL_S)
        typer.echo("stopping")
    finally:
        server.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _check_gc_switch() -> None:
    try:
        gc_freeze_enabled()
    except ValueError as e:
        _fail(str(e))


def serve(
    store: Annotated[Path, typer.Option("--store", help="Weight store directory to serve (read-only).")],
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on (0 picks a free one).")] = 8765,
    bandwidth_mbps: Annotated[
        float | None, typer.Option(help="Cap the server's total egress at this many Mbit/s (simulation).")
    ] = None,
    send_stall_s: SendStallOption = DEFAULT_SEND_STALL_S,
    min_send_kib_s: MinSendRateOption = DEFAULT_MIN_SEND_RATE / 1024,
) -> None:
    """Serve a weight store over HTTP: /v1/weights/latest, manifests/N, blobs/SHA256 (with Range)."""
    _check_port(port)
    _check_gc_switch()
    rate = _bandwidth("--bandwidth-mbps", bandwidth_mbps)
    stall, floor = _send_bounds(send_stall_s, min_send_kib_s)
    if not store.is_dir():
        _fail(f"--store {str(store)!r} is not an existing directory; pass a weight store directory")
    try:
        opened = WeightStore.open(store)
        server = serve_store(opened, host, port, rate, send_stall_s=stall, min_send_rate=floor)
    except NotAStoreError as e:
        _fail(f"--store {str(store)!r}: {e}")
        return
    except OSError as e:
        _fail(f"cannot listen on {host}:{port}: {e}")
        return
    latest = opened.latest()
    banner = f"serving weight store {store} (latest version {latest}) at {server.url}"
    _block_until_interrupted(server, banner)


def relay(
    upstream: Annotated[
        list[str],
        typer.Option(help="Upstream server or relay URL, e.g. http://trainer:8765 (repeat for fallbacks)."),
    ],
    cache_dir: Annotated[Path, typer.Option(help="Directory for the relay's verified blob cache.")] = Path(
        ".tandem-relay-cache"
    ),
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on (0 picks a free one).")] = 8766,
    upstream_bandwidth_mbps: Annotated[
        float | None, typer.Option(help="Cap the relay's upstream link at this many Mbit/s (simulation).")
    ] = None,
    send_stall_s: SendStallOption = DEFAULT_SEND_STALL_S,
    min_send_kib_s: MinSendRateOption = DEFAULT_MIN_SEND_RATE / 1024,
) -> None:
    """Relay a weight server to local clients: fetch each blob once from upstream, cache it, serve many."""
    if not upstream:
        _fail("--upstream URL is required (the weight server to relay, e.g. http://127.0.0.1:8765)")
    for url in upstream:
        try:
            parse_source(url)
        except TransportError as e:
            _fail(f"--upstream: {e}")
    _check_port(port)
    _check_gc_switch()
    rate = _bandwidth("--upstream-bandwidth-mbps", upstream_bandwidth_mbps)
    stall, floor = _send_bounds(send_stall_s, min_send_kib_s)
    if cache_dir.exists() and not cache_dir.is_dir():
        _fail(f"--cache-dir {str(cache_dir)!r} exists and is not a directory")
    try:
        server = Relay(
            upstream, cache_dir, host, port, upstream_bandwidth_bytes_per_s=rate, send_stall_s=stall,
            min_send_rate=floor,
        )  # fmt: skip
    except WeightStoreError as e:
        _fail(f"--cache-dir: {e}")
        return
    except OSError as e:
        _fail(f"cannot listen on {host}:{port}: {e}")
        return
    try:
        latest = server.latest()
    except WeightStoreError as e:
        latest = None
        typer.echo(f"warning: upstream not reachable yet ({e}); will retry on each request", err=True)
    banner = f"relaying {', '.join(upstream)} (latest version {latest}) at {server.url}"
    _block_until_interrupted(server, banner)

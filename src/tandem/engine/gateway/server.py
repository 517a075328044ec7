"""Running the gateway app under uvicorn: in the foreground (``tandem serve``) or in a background thread.

Invariants:
- The listening socket is bound before uvicorn starts, so a bad address or a port in use is an ``OSError``
  raised to the caller (not a log line and ``sys.exit`` inside uvicorn), and port 0 yields the real port.
- ``GatewayServer.start`` returns only once the server accepts connections; ``stop`` closes the server and
  joins its thread. Neither touches the engine.
- One serving thread per ``GatewayServer``, ever: a second ``start`` is refused, and entering a ``with`` block
  on a started server (``with GatewayServer(app).start() as srv``) does not start it again. Two threads had
  served one socket; ``stop`` joined the second only, and the first, closing its loop later, closed the
  socket's descriptor number again after the next server had been given it (that server stopped listening).
- ``cpu_s`` is the CPU time the serving thread has used (its event loop: HTTP parsing, the app's handlers,
  responses), read from the thread's own CPU clock; 0.0 before ``start`` (and once the thread died).
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import uvicorn

from tandem.core.procs import thread_cpu_s


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (IPv6 when ``host`` contains ':')."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host.strip("[]"), port))
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def _config(app: Any, log_level: str, access_log: bool) -> uvicorn.Config:
    return uvicorn.Config(
        app, log_level=log_level, access_log=access_log, lifespan="off", timeout_keep_alive=30
    )


def run_forever(app: Any, sock: socket.socket, log_level: str = "info", access_log: bool = True) -> None:
    """Serve ``app`` on ``sock`` in the calling thread until SIGINT/SIGTERM."""
    uvicorn.Server(_config(app, log_level, access_log)).run(sockets=[sock])


class GatewayServer:
    """The app served by uvicorn in a daemon thread, on ``host:port`` (port 0: a free one, see ``port``)."""

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning") -> None:
        self.sock = bind_socket(host, port)
        self.host = host
        self.port = int(self.sock.getsockname()[1])
        self._server = uvicorn.Server(_config(app, log_level, access_log=False))
        self._thread: threading.Thread | None = None
        self._cpu_at_stop: float | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def start(self, timeout_s: float = 30.0) -> GatewayServer:
        if self._thread is not None:
            raise RuntimeError(f"the gateway server on {self.url} was already started; start it once")
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self.sock]}, name="tandem-gateway", daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the gateway server on {self.url} did not start")
            time.sleep(0.01)
        return self

    def cpu_s(self) -> float:
        """CPU seconds the serving thread has used so far (see module invariants); after ``stop``, what it
        had used when ``stop`` began."""
        if self._cpu_at_stop is not None:
            return self._cpu_at_stop
        return thread_cpu_s(self._thread)

    def stop(self) -> None:
        self._cpu_at_stop = self.cpu_s()
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=30)
        self.sock.close()

    def __enter__(self) -> GatewayServer:
        return self if self._thread is not None else self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

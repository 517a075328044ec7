"""One door out of a sandbox: its loopback port reaches the rollout gateway, and nothing else does.

A bwrap sandbox has its own network namespace with only a loopback interface, so a harness inside cannot
reach any host address. To let it call the gateway (and only the gateway):
- on the host, :class:`SocketForwarder` listens on a unix socket inside the sandbox's private directory and
  relays every connection to the gateway's TCP address;
- that directory is bind-mounted at ``/run/tandem`` inside the sandbox, and :func:`launcher_argv` wraps
  the harness command in a small Python launcher that listens on ``127.0.0.1:PORT`` inside the sandbox,
  relays each connection to ``/run/tandem/gateway.sock``, runs the command, and exits with its status.

Invariants: the forwarder relays bytes to one fixed address (the gateway's), so nothing else of the host
is reachable through it; it relays at most ``MAX_CONNECTIONS`` connections at once (the rest wait in the
socket's backlog), so a sandbox cannot start host threads without bound; the socket file belongs to the
sandbox's agent uid; :meth:`SocketForwarder.close` stops accepting and closes every relayed connection.
"""

from __future__ import annotations

import os
import socket
import threading
from pathlib import Path
from urllib.parse import urlparse

from tandem.core.errors import SandboxError

SANDBOX_DIR = "/run/tandem"
SOCKET_NAME = "gateway.sock"
SANDBOX_PORT = 8000
"""The port the launcher listens on inside the sandbox's own loopback (no host port is used)."""

RELAY = r"""
import socket
def pipe(a, b):
    try:
        while True:
            data = a.recv(65536)
            if not data:
                break
            b.sendall(data)
    except OSError:
        pass
    finally:
        for s in (a, b):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
"""
"""Copies bytes from socket ``a`` to ``b`` until either side ends, then shuts both down (used on the host and,
as source, inside the sandbox's launcher)."""

LAUNCHER = (
    RELAY
    + r"""
import os, subprocess, sys, threading
port, path, cmd = int(sys.argv[1]), sys.argv[2], sys.argv[4:]
def serve(listener):
    while True:
        conn, _ = listener.accept()
        up = socket.socket(socket.AF_UNIX)
        try:
            up.connect(path)
        except OSError:
            conn.close()
            continue
        for a, b in ((conn, up), (up, conn)):
            threading.Thread(target=pipe, args=(a, b), daemon=True).start()
listener = socket.socket()
listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
listener.bind(("127.0.0.1", port))
listener.listen(64)
threading.Thread(target=serve, args=(listener,), daemon=True).start()
try:
    code = subprocess.call(cmd)
except OSError as e:
    print(f"tandem launcher: cannot run {cmd[0]!r}: {e}", file=sys.stderr)
    code = 127
sys.stdout.flush()
os._exit(code if code >= 0 else 128 - code)
"""
)


def launcher_argv(cmd: list[str], port: int = SANDBOX_PORT) -> list[str]:
    """``cmd`` wrapped so that ``http://127.0.0.1:port`` inside the sandbox reaches the gateway."""
    return ["python3", "-I", "-S", "-c", LAUNCHER, str(port), f"{SANDBOX_DIR}/{SOCKET_NAME}", "--", *cmd]


_namespace: dict[str, object] = {}
exec(compile(RELAY, "<tandem relay>", "exec"), _namespace)  # the same relay code as inside the sandbox
_relay = _namespace["pipe"]

MAX_CONNECTIONS = 32
"""Connections one sandbox's forwarder relays at once (two host threads each); more wait in the socket's
backlog until one ends. A probe opened 200 connections straight to the socket (410 threads on the host, and
nothing bounded it below the machine's pid limit)."""


class SocketForwarder:
    """Relays connections on a unix socket to the gateway at ``url`` (``http://host:port[/...]``)."""

    def __init__(self, url: str, directory: Path, owner: int | None) -> None:
        parsed = urlparse(url)
        if parsed.scheme != "http" or not parsed.hostname or not parsed.port:
            raise SandboxError(f"gateway url {url!r} must look like http://127.0.0.1:PORT[/v1]")
        self.target = (parsed.hostname, parsed.port)
        directory.mkdir(mode=0o755, exist_ok=True)
        self.path = directory / SOCKET_NAME
        self._server = socket.socket(socket.AF_UNIX)
        self._server.bind(str(self.path))
        os.chmod(self.path, 0o600)
        if owner is not None:
            os.chown(directory, owner, owner)
            os.chown(self.path, owner, owner)
        self._server.listen(64)
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._closed = False
        threading.Thread(target=self._accept, name="tandem-gateway-forwarder", daemon=True).start()

    def _accept(self) -> None:
        while True:
            self._slots.acquire()  # at most MAX_CONNECTIONS relayed at once; the rest wait in the backlog
            try:
                conn, _ = self._server.accept()
            except OSError:
                self._slots.release()
                return
            try:
                up = socket.create_connection(self.target, timeout=10)
                up.settimeout(None)
                up.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                conn.close()
                self._slots.release()
                continue
            with self._lock:
                if self._closed:
                    conn.close()
                    up.close()
                    return
                self._conns |= {conn, up}
            ends = [2]  # the two directions of this connection; the last to end frees its slot

            def relay(a: socket.socket, b: socket.socket, ends: list[int] = ends) -> None:
                try:
                    _relay(a, b)
                finally:
                    with self._lock:
                        ends[0] -= 1
                        last = ends[0] == 0
                        if last:
                            self._conns -= {a, b}
                    if last:
                        a.close()
                        b.close()
                        self._slots.release()

            for a, b in ((conn, up), (up, conn)):
                threading.Thread(target=relay, args=(a, b), daemon=True).start()

    def close(self) -> None:
        """Stop accepting and close every relayed connection. Idempotent."""
        with self._lock:
            self._closed = True
            conns, self._conns = list(self._conns), set()
        for s in [self._server, *conns]:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

"""An OpenAI chat endpoint that answers every request at once: the reference `tandem bench gateway` measures
its client against.

`tandem bench gateway` runs the same `openai` client processes against this server, with the same sessions,
turns, tools and messages as its gateway rounds. With every answer there at once, a round's wall time is the
client's own work (reading answers, building and sending the next requests) plus loopback latency: what a
gateway and engine that cost nothing would still leave on each round, since the benchmark's sessions finish
each turn together and the next turn's requests exist only once the client has built them.

Invariants:
- Every well-formed ``POST`` is answered ``200`` with the same canned ``chat.completion``: an assistant
  message whose ``content`` is ``max_tokens`` short words (about the characters of that many sampled tokens)
  and ``usage.completion_tokens == max_tokens``. The body is read (its ``Content-Length``) but not parsed, so
  the server's own work per request is a few microseconds beside the client's milliseconds. Non-streamed
  only: the benchmark does not stream.
- HTTP/1.1 keep-alive: a connection serves requests until the client closes it.
- A request that is not a ``POST`` with one ``Content-Length`` of at most ``MAX_BODY_BYTES`` gets ``400`` and
  its connection is closed; a head longer than ``MAX_HEAD_BYTES`` has its connection closed unanswered. No
  input raises into the server's loop, and every other connection is served as before.
- Loopback only (127.0.0.1). ``start`` returns once the socket listens; ``stop`` closes the server and joins
  its thread. One start per server.
"""

from __future__ import annotations

import asyncio
import json
import threading

from tandem.core.procs import thread_cpu_s

MAX_HEAD_BYTES = 64 * 1024
"""Longest request line plus headers taken; httpx sends well under 1 KiB."""
MAX_BODY_BYTES = 64 * 1024 * 1024
"""Largest request body taken (the benchmark's longest history is tens of KiB)."""

_BAD_REQUEST = b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"


def canned_completion(max_tokens: int) -> bytes:
    """The one response body: a ``chat.completion`` of ``max_tokens`` words, cut by length."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens={max_tokens} must be at least 1")
    return json.dumps(
        {
            "id": "chatcmpl-instant",
            "object": "chat.completion",
            "created": 0,
            "model": "tandem",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": " ok" * max_tokens},
                    "finish_reason": "length",
                    "logprobs": None,
                }
            ],
            "usage": {"prompt_tokens": 0, "completion_tokens": max_tokens, "total_tokens": max_tokens},
        }
    ).encode()


class InstantChatServer:
    """Serves ``canned_completion(max_tokens)`` to every request on 127.0.0.1 (a free port), from a thread."""

    def __init__(self, max_tokens: int) -> None:
        body = canned_completion(max_tokens)
        head = f"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
        self._response = head.encode() + body
        self.port = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopped: asyncio.Event | None = None
        self._error: BaseException | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 10.0) -> InstantChatServer:
        if self._thread is not None:
            raise RuntimeError("the instant chat server was already started; start it once")
        ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(ready,), name="tandem-instant", daemon=True)
        self._thread.start()
        if not ready.wait(timeout_s) or self._error is not None:
            raise RuntimeError(f"the instant chat server did not start: {self._error!r}")
        return self

    def _run(self, ready: threading.Event) -> None:
        async def main() -> None:
            self._loop = asyncio.get_running_loop()
            self._stopped = asyncio.Event()
            server = await asyncio.start_server(self._serve, "127.0.0.1", 0, limit=MAX_HEAD_BYTES)
            self.port = int(server.sockets[0].getsockname()[1])
            ready.set()
            async with server:
                await self._stopped.wait()

        try:
            asyncio.run(main())
        except BaseException as e:  # noqa: BLE001 - reported by start()
            self._error = e
            ready.set()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = _content_length(head)
                if length is None:
                    writer.write(_BAD_REQUEST)
                    await writer.drain()
                    return
                await reader.readexactly(length)
                writer.write(self._response)
                await writer.drain()
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            return  # the client closed (between requests or mid-way), or sent a head over the limit
        finally:
            writer.close()

    def cpu_s(self) -> float:
        """CPU seconds the serving thread has used so far (0.0 before start or once it ended)."""
        return thread_cpu_s(self._thread)

    def stop(self) -> None:
        if self._loop is not None and self._stopped is not None:
            self._loop.call_soon_threadsafe(self._stopped.set)
        if self._thread is not None:
            self._thread.join(timeout=10)


def _content_length(head: bytes) -> int | None:
    """The body length of a ``POST`` head, or None when the request is not one this server answers."""
    lines = head.split(b"\r\n")
    if lines[0].split(b" ", 1)[0] != b"POST":
        return None
    length = None
    for line in lines[1:]:
        name, sep, value = line.partition(b":")
        if sep and name.strip().lower() == b"content-length":
            value = value.strip()
            if not value.isdigit() or length is not None:
                return None
            length = int(value)
    if length is None or length > MAX_BODY_BYTES:
        return None
    return length

"""Stopping a run on request: Ctrl-C, SIGTERM (a scheduler's preemption, ``kill``, ``timeout``) or SIGHUP (a
closed terminal) ends a run the same way, through the run's own stop path, not through Ray's default
handler (which exits the driver at once and leaves the actors' sandboxes to the next run's sweep).

Invariants:
- Inside :func:`stop_on_signals` (main thread only; elsewhere it changes nothing), SIGTERM and SIGHUP raise
  :class:`StopRequested` in the main thread and SIGINT raises it too (instead of ``KeyboardInterrupt``), so
  one ``except StopRequested`` covers the three. It derives from ``BaseException``: the run's ``except
  Exception`` blocks (which turn failures into errors) never swallow it.
- The first signal restores the handlers that were there before, so a second signal acts as it would have
  without tandem (Ctrl-C raises ``KeyboardInterrupt``, SIGTERM exits): a user can always cut a slow stop
  short. Leaving the block restores them too.
- A handler's exception raised inside a C extension's call (Ray's, while an actor handle is made) can come out
  as another exception (``SystemError``) that the run's failure paths would take for a failure: the signal
  is also recorded, and :func:`stop_requested` says which arrived in the current block, so those paths
  turn it back into a stop (``StopRequested`` from :func:`raise_if_stopping`).
- :class:`RunStopped` is the error the run raises once it has stopped: its message says at which step, what
  was saved and how to continue; ``exit_code`` is the shell's convention for the signal, 128 + its number.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from tandem.core.errors import TandemError

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
"""Signals that stop a run through its stop path."""


class StopRequested(BaseException):
    """A stop signal arrived; ``signum`` is which."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class RunStopped(TandemError):
    """The run stopped on a signal after saving what it had; ``exit_code`` = 128 + the signal's number."""

    def __init__(self, message: str, signum: int) -> None:
        super().__init__(message)
        self.signum = signum
        self.exit_code = 128 + signum


_requested: int | None = None


def stop_requested() -> int | None:
    """The stop signal received inside the current :func:`stop_on_signals` block, if any."""
    return _requested


def raise_if_stopping(error: BaseException) -> None:
    """Raise ``StopRequested`` (from ``error``) when a stop signal arrived: ``error`` is then most likely
    that signal's exception, mangled by the C code it was raised in (module invariants)."""
    if _requested is not None:
        raise StopRequested(_requested) from error


@contextmanager
def stop_on_signals() -> Iterator[None]:
    """Turn the stop signals into :class:`StopRequested` while inside (module invariants)."""
    global _requested
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _requested = None
    previous = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}

    def restore() -> None:
        for sig, handler in previous.items():
            try:
                signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
            except (ValueError, OSError):
                pass

    def on_signal(signum: int, frame: object) -> None:
        global _requested
        restore()  # a second signal acts at once
        _requested = signum
        raise StopRequested(signum)

    for sig in STOP_SIGNALS:
        try:
            signal.signal(sig, on_signal)
        except (ValueError, OSError):  # not the main interpreter, or the platform refuses
            pass
    try:
        yield
    finally:
        restore()
        _requested = None

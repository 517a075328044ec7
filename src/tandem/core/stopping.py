"""Stopping on request: Ctrl-C, SIGTERM (a scheduler's preemption, ``kill``, ``timeout``) or SIGHUP (a closed
terminal) ends a long command (``tandem train``, ``tandem midtrain``) through its own stop path, which saves
what it has and says how to continue, instead of Python's traceback, Ray's handler (which exits the driver at
once) or the default action (which kills without saving).

Invariants:
- Inside :func:`stop_on_signals` (main thread only; elsewhere it changes nothing and yields a state no signal
  ever sets), the first of SIGINT, SIGTERM and SIGHUP is recorded in the yielded :class:`StopState` and
  raises :class:`StopRequested` in the main thread, unless a :func:`deferred` block is running: then it is
  only recorded, for the loop inside to see at its next safe point (a step boundary: an exception in the
  middle of an optimizer step would leave half-updated weights). ``StopRequested`` derives from
  ``BaseException``: ``except Exception`` blocks (failure paths) never swallow it.
- The first signal restores the handlers that were there before, so a second signal acts as it would have
  without tandem (Ctrl-C raises ``KeyboardInterrupt``, SIGTERM kills or exits): a user can always cut a slow
  stop short. Leaving the block restores them too.
- A handler's exception raised inside a C extension's call (Ray's, while an actor handle is made) can come out
  as another exception (``SystemError``) that a failure path would take for a failure: the signal is
  recorded too, and :func:`raise_if_stopping` turns such an exception back into ``StopRequested``.
- :class:`StoppedError` is what a command raises once it has stopped and saved: its message says what was
  saved and how to continue; ``exit_code`` is the shell's convention for the signal, 128 + its number.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from tandem.core.errors import TandemError

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
"""Signals that stop a command through its stop path."""


class StopRequested(BaseException):
    """A stop signal arrived; ``signum`` is which."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class StoppedError(TandemError):
    """A command stopped on a signal after saving what it had; ``exit_code`` = 128 + the signal's number."""

    def __init__(self, message: str, signum: int) -> None:
        super().__init__(message)
        self.signum = signum
        self.exit_code = 128 + signum


@dataclass
class StopState:
    """What :func:`stop_on_signals` has seen: ``signum`` is the first stop signal (None before one)."""

    signum: int | None = None
    defer: bool = False
    """While True (a :func:`deferred` block) a signal is only recorded, not raised."""

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else ""


_current: StopState | None = None


def current() -> StopState | None:
    """The state of the innermost running :func:`stop_on_signals` block of the main thread, if any."""
    return _current


def raise_if_stopping(error: BaseException) -> None:
    """Raise ``StopRequested`` (from ``error``) when a stop signal arrived: ``error`` is then most likely that
    signal's exception, mangled by the C code it was raised in (module invariants)."""
    if _current is not None and _current.signum is not None:
        raise StopRequested(_current.signum) from error


@contextmanager
def deferred() -> Iterator[StopState | None]:
    """Inside, a stop signal is only recorded in the current state (module invariants); yields that state
    (None outside :func:`stop_on_signals`: nothing to watch)."""
    state = _current
    if state is None:
        yield None
        return
    before, state.defer = state.defer, True
    try:
        yield state
    finally:
        state.defer = before


@contextmanager
def stop_on_signals() -> Iterator[StopState]:
    """Record the stop signals, and raise them as :class:`StopRequested`, while inside (module invariants)."""
    global _current
    state = StopState()
    if threading.current_thread() is not threading.main_thread():
        yield state
        return
    previous = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}

    def restore() -> None:
        for sig, handler in previous.items():
            try:
                signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
            except (ValueError, OSError):
                pass

    def on_signal(signum: int, frame: object) -> None:
        restore()  # a second signal acts at once
        state.signum = signum
        if not state.defer:
            raise StopRequested(signum)

    for sig in STOP_SIGNALS:
        try:
            signal.signal(sig, on_signal)
        except (ValueError, OSError):  # not the main interpreter, or the platform refuses
            pass
    outer, _current = _current, state
    try:
        yield state
    finally:
        restore()
        _current = outer

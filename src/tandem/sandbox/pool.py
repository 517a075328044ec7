"""Hiding sandbox start latency: a warm pool of ready sandboxes per workspace.

Invariants:
- :class:`SandboxPool` keeps up to ``size`` ready sandboxes of one workspace (a dict, a directory or a
  :class:`~tandem.sandbox.layers.WorkspaceTemplate`), created on one background thread. :meth:`acquire`
  hands out a ready sandbox (a hit) or, when none is ready, creates one on the caller's thread (a miss);
  a sandbox is handed out once and never returned to the pool (every acquire gets a pristine workspace).
  :meth:`close` stops the filler and closes the sandboxes not handed out. Creation failures are kept and
  re-raised by the next :meth:`acquire` that has to create synchronously, never swallowed.
- Closing is hidden too: :meth:`Sandbox.close` with ``wait=False`` kills every process at once and hands the
  slow rest (unmount, delete, cgroup removal) to ``tandem.sandbox.reaper``.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from pathlib import Path

from tandem.core.config import SandboxConfig
from tandem.core.errors import SandboxError
from tandem.sandbox.base import Sandbox
from tandem.sandbox.layers import WorkspaceTemplate


class SandboxPool:
    """Ready sandboxes of one workspace, refilled in the background (see module invariants)."""

    def __init__(
        self,
        workspace: dict[str, str] | Path | WorkspaceTemplate,
        config: SandboxConfig,
        size: int,
        factory: Callable[[dict[str, str] | Path | WorkspaceTemplate, SandboxConfig], Sandbox] | None = None,
    ) -> None:
        if size < 0:
            raise SandboxError(f"pool size must be >= 0, got {size}")
        from tandem.sandbox.cleanup import exit_on_signals
        from tandem.sandbox.factory import create_sandbox

        exit_on_signals()  # the filler thread cannot: signal handlers are set on the main thread
        self.workspace, self.config, self.size = workspace, config, size
        self._create = factory or create_sandbox
        self._ready: deque[Sandbox] = deque()
        self._cond = threading.Condition()
        self._closed = False
        self._error: BaseException | None = None
        self.hits = 0
        """Acquires served by a ready sandbox."""
        self.misses = 0
        """Acquires that had to create a sandbox on the caller's thread."""
        self._filler = threading.Thread(target=self._fill, name="tandem-sandbox-pool", daemon=True)
        self._filler.start()

    def _fill(self) -> None:
        while True:
            with self._cond:
                while not self._closed and (len(self._ready) >= self.size or self._error is not None):
                    self._cond.wait()
                if self._closed:
                    return
            try:
                box = self._create(self.workspace, self.config)
            except BaseException as e:  # noqa: BLE001 - surfaced by the next acquire
                with self._cond:
                    self._error = e
                continue
            with self._cond:
                if self._closed:
                    box.close(wait=False)
                    return
                self._ready.append(box)

    def acquire(self) -> Sandbox:
        """A pristine sandbox of the pool's workspace; the caller closes it."""
        with self._cond:
            if self._closed:
                raise SandboxError("the sandbox pool is closed; create a new one")
            if self._ready:
                self.hits += 1
                box = self._ready.popleft()
                self._cond.notify_all()
                return box
            self.misses += 1
            error, self._error = self._error, None
            self._cond.notify_all()
        if error is not None:
            raise SandboxError(f"creating a pooled sandbox failed: {error}") from error
        return self._create(self.workspace, self.config)

    def close(self) -> None:
        """Stop refilling and close every sandbox not handed out. Idempotent."""
        with self._cond:
            self._closed = True
            left = list(self._ready)
            self._ready.clear()
            self._cond.notify_all()
        for box in left:
            box.close(wait=False)
        self._filler.join(timeout=30)

    def __enter__(self) -> SandboxPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

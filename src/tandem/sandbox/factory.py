"""Choosing a sandbox backend by name.

Invariant: the backend is exactly ``config.backend``; there is no silent fallback from ``bwrap`` to the
unisolated ``plain`` backend (a missing bwrap is a :class:`SandboxError` that says how to opt in).
"""

from __future__ import annotations

from pathlib import Path

from tandem.core.config import SandboxConfig
from tandem.core.errors import SandboxError
from tandem.sandbox.base import Sandbox
from tandem.sandbox.bwrap import BwrapSandbox
from tandem.sandbox.plain import PlainSandbox

BACKENDS: dict[str, type[Sandbox]] = {"bwrap": BwrapSandbox, "plain": PlainSandbox}


def create_sandbox(workspace: dict[str, str] | Path, config: SandboxConfig) -> Sandbox:
    """A new sandbox holding a private copy of ``workspace`` (files to write, or a directory to copy)."""
    try:
        cls = BACKENDS[config.backend]
    except KeyError:
        raise SandboxError(
            f"unknown sandbox backend {config.backend!r}; choose one of {sorted(BACKENDS)}"
        ) from None
    return cls(workspace, config)

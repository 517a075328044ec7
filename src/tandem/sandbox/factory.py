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
from tandem.sandbox.layers import WorkspaceTemplate
from tandem.sandbox.plain import PlainSandbox

BACKENDS: dict[str, type[Sandbox]] = {"bwrap": BwrapSandbox, "plain": PlainSandbox}


def create_sandbox(
    workspace: dict[str, str] | Path | WorkspaceTemplate,
    config: SandboxConfig,
    gateway: str | None = None,
    ro_mounts: list[str] | None = None,
    hidden: list[str] | None = None,
) -> Sandbox:
    """A new sandbox with a private view of ``workspace`` (files, a directory, or a template of either).

    With ``gateway`` (``http://HOST:PORT/v1``), commands wrapped by :meth:`Sandbox.with_gateway` reach that
    address, and only that one, at :meth:`Sandbox.gateway_url`. ``ro_mounts`` are host paths made visible
    read-only at their own paths (bwrap; the plain backend sees the whole host anyway); ``hidden`` are host
    paths inside those mounts that the sandbox sees empty (an empty read-only directory or file bound over
    each; with bwrap only: the plain backend hides nothing, as it isolates nothing)."""
    try:
        cls = BACKENDS[config.backend]
    except KeyError:
        raise SandboxError(
            f"unknown sandbox backend {config.backend!r}; choose one of {sorted(BACKENDS)}"
        ) from None
    return cls(workspace, config, gateway, ro_mounts, hidden)

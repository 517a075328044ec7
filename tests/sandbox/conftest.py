"""Helpers shared by the sandbox tests (real bwrap, real processes, no mocks)."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import pytest

from tandem.core.config import SandboxConfig


def procs_with(marker: str) -> list[int]:
    """Pids of live (non-zombie) processes whose command line contains ``marker``."""
    found = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                if marker.encode() in (p / "cmdline").read_bytes():
                    found.append(int(p.name))
            except OSError:
                pass
    return found


def wait_no_procs(marker: str, within_s: float = 5.0) -> list[int]:
    """Processes with ``marker`` still alive after waiting up to ``within_s`` (SIGKILL delivery is async)."""
    end = time.monotonic() + within_s
    while (left := procs_with(marker)) and time.monotonic() < end:
        time.sleep(0.05)
    return left


@pytest.fixture
def marker() -> str:
    return f"tandem-test-marker-{uuid.uuid4().hex}"


@pytest.fixture
def cfg() -> SandboxConfig:
    return SandboxConfig(backend="bwrap", timeout_s=20.0)

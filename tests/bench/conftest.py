"""Shared by the bench tests: ``bench_cli`` runs ``tandem bench NAME ARGS...`` as a user does (a subprocess in
the repository root) and returns the finished process."""

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def run_bench(name: str, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tandem.cli.main", "bench", name, *args],
        cwd=REPO, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


@pytest.fixture
def bench_cli() -> Callable[..., subprocess.CompletedProcess]:
    return run_bench

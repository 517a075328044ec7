"""The plain (unisolated, opt-in) backend: it warns, and still enforces limits and kills its process tree."""

from __future__ import annotations

import logging

import pytest

from tandem.core.config import SandboxConfig
from tandem.sandbox import PlainSandbox, create_sandbox, plain

from .conftest import wait_no_procs


@pytest.fixture
def cfg() -> SandboxConfig:
    return SandboxConfig(backend="plain", timeout_s=20.0)


def test_plain_warns_once(cfg: SandboxConfig, monkeypatch, caplog, capsys) -> None:
    monkeypatch.setattr(plain, "_warned", False)
    with caplog.at_level(logging.WARNING, logger="tandem.sandbox.plain"):
        create_sandbox({}, cfg).close()
        create_sandbox({}, cfg).close()
    assert [r.message for r in caplog.records].count(plain.WARNING) == 1
    assert capsys.readouterr().err.count("WITHOUT isolation") == 1


def test_plain_runs_in_private_copy_with_limits(cfg: SandboxConfig, tmp_path) -> None:
    (tmp_path / "a.txt").write_text("original")
    with create_sandbox(tmp_path, cfg) as s:
        assert isinstance(s, PlainSandbox)
        r = s.exec(["sh", "-c", 'pwd; echo changed > a.txt; echo "$HOME"; ulimit -n; echo e >&2; exit 4'])
        assert (r.exit_code, r.stderr) == (4, "e\n")
        assert r.stdout.split() == [str(s.workdir), str(s.workdir), "256"]
        assert s.read("a.txt") == "changed\n"
    assert (tmp_path / "a.txt").read_text() == "original"


def test_plain_timeout_and_leftovers_are_killed(cfg: SandboxConfig, marker: str) -> None:
    with create_sandbox({}, cfg) as s:
        code = "import os, time\nos.fork()\ntime.sleep(100)\n"
        r = s.exec(["python3", "-c", code, marker], timeout_s=1.0)
        assert (r.exit_code, r.timed_out) == (124, True)
        assert wait_no_procs(marker) == []
        r = s.exec(["sh", "-c", f"python3 -c 'import time; time.sleep(100)' {marker} & echo bg"])
        assert (r.exit_code, r.stdout, r.timed_out) == (0, "bg\n", False)
        assert wait_no_procs(marker) == []

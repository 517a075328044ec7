"""`tandem sandbox run`: run one command in a sandbox holding a private copy of a directory.

Invariants: the command's stdout and stderr are printed on ours and its exit status is ours (124 on timeout,
128+N when killed by signal N); the directory itself is never modified. ``--timeout``, ``--memory`` (MB),
``--pids`` and ``--max-output`` (bytes per stream, cut with a visible marker) override the ``SandboxConfig``
defaults; a command killed by SIGKILL or failing with MemoryError gets a note on stderr naming the limits.
Bad input (missing directory, a directory holding the temp dir or on a kernel pseudo file system such as
``/proc``, empty command, unknown backend, unusable bwrap, a limit <= 0 or past ``MOST``)
prints one ``error:`` line naming the flag or value and exits with status 2; so does a command that fills
the sandbox's disk (``sandbox.disk_mb``), after its output.
"""

from __future__ import annotations

import math
import os
import stat
import sys
import tempfile
from pathlib import Path
from typing import Annotated

import typer

from tandem.core.config import (
    SANDBOX_MAX_CPUS,
    SANDBOX_MAX_MB,
    SANDBOX_MAX_OUTPUT_BYTES,
    SANDBOX_MAX_PIDS,
    SANDBOX_MAX_TIMEOUT_S,
    SANDBOX_MIN_BWRAP_PIDS,
    SANDBOX_MIN_MEMORY_MB,
    SandboxConfig,
)
from tandem.core.errors import TandemError
from tandem.core.pseudofs import pseudo_filesystems
from tandem.sandbox import SandboxDiskFull, create_sandbox

app = typer.Typer(
    help="Run commands in an isolated sandbox (bubblewrap: no network, read-only system, private workspace).",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)


@app.callback()
def _group() -> None:
    """Run commands in an isolated sandbox."""


def _fail(message: str) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(2)


MOST: dict[str, tuple[int, str]] = {
    "--timeout": (SANDBOX_MAX_TIMEOUT_S, "a week; longer overflowed the wait for the command"),
    "--memory": (SANDBOX_MAX_MB, "16 TiB; bwrap and ulimit refused larger sizes mid-start"),
    "--pids": (SANDBOX_MAX_PIDS, "the most processes Linux can have, PID_MAX_LIMIT; ulimit refused more"),
    "--max-output": (SANDBOX_MAX_OUTPUT_BYTES, "1 GiB per stream, held in memory; more was a traceback"),
    "--cpus": (int(SANDBOX_MAX_CPUS), "the most sandbox.cpus takes"),
}
"""Largest value per option, and why; past it the sandbox failed to start with an unclear message."""


def _check_most(flag: str, value: float) -> None:
    """Refuse ``value`` past ``MOST[flag]`` (options without an entry have no upper bound)."""
    if flag in MOST and value > MOST[flag][0]:
        most, why = MOST[flag]
        _fail(f"{flag} must be <= {most} ({why}), got {value}")


_KINDS = {
    stat.S_IFIFO: "a named pipe",
    stat.S_IFSOCK: "a socket",
    stat.S_IFCHR: "a device",
    stat.S_IFBLK: "a device",
}


def _check_not_inside(root: Path) -> None:
    """Refuse a workspace that holds the temp dir, where the sandbox's copy of it is made: the copy copied
    itself until its paths grew too long (``--workspace /`` copied the host's whole disk into itself)."""
    tmp = Path(os.path.realpath(tempfile.gettempdir()))
    if tmp.is_relative_to(os.path.realpath(root)):
        _fail(
            f"--workspace {str(root)!r} holds the temp dir {str(tmp)!r}, where the sandbox's copy of it is "
            "made (it would copy its own copy); pass a directory that does not hold it, or set TMPDIR "
            "elsewhere"
        )


def _check_copyable(root: Path) -> None:
    """Refuse a workspace holding anything but files, directories and symlinks (the copy into the sandbox
    cannot take a named pipe, a socket or a device: it failed with a traceback), or any directory on a kernel
    pseudo file system (``core.pseudofs``); symlinks are not followed. Stops at the first
    refusal."""
    pseudo = pseudo_filesystems()
    for dirpath, _, filenames in os.walk(root):
        try:
            kind = pseudo.get((os.stat if dirpath == str(root) else os.lstat)(dirpath).st_dev)
        except OSError:
            continue  # gone since the listing: nothing to copy
        if kind is not None:
            rel = os.path.relpath(dirpath, root)
            where = "is" if rel == "." else f"holds {rel!r}, which is"
            _fail(
                f"--workspace {str(root)!r} {where} on a {kind} file system (kernel files, which can block "
                "or never end when read, not data to copy); pass a directory of ordinary files"
            )
        for name in filenames:
            path = Path(dirpath, name)
            try:
                kind = _KINDS.get(stat.S_IFMT(os.lstat(path).st_mode))
            except OSError:
                continue  # gone since the listing: nothing to copy
            if kind is not None:
                _fail(
                    f"--workspace {str(root)!r} holds {str(path.relative_to(root))!r}, {kind}; a sandbox "
                    "workspace can hold only files, directories and symlinks: remove it or pass another "
                    "directory"
                )


@app.command(context_settings={"allow_interspersed_args": False, "ignore_unknown_options": True})
def run(
    cmd: Annotated[
        list[str] | None, typer.Argument(help="The command and its arguments (after `--`).")
    ] = None,
    workspace: Annotated[
        Path | None, typer.Option("--workspace", help="Directory copied into the sandbox as /workspace.")
    ] = None,
    backend: Annotated[
        str, typer.Option(help="`bwrap` (isolated) or `plain` (unisolated, warns).")
    ] = "bwrap",
    timeout: Annotated[
        float | None, typer.Option(help="Wall-clock limit in seconds (default: sandbox.timeout_s).")
    ] = None,
    memory: Annotated[
        int | None, typer.Option(help="Memory limit in MB (default: sandbox.memory_mb).")
    ] = None,
    pids: Annotated[int | None, typer.Option(help="Most processes (default: sandbox.pids).")] = None,
    cpus: Annotated[
        float | None,
        typer.Option(help="Most CPUs the command's processes use together (default: sandbox.cpus, 1)."),
    ] = None,
    max_output: Annotated[
        int | None,
        typer.Option("--max-output", help="Bytes kept per stream; the rest is cut with a visible marker."),
    ] = None,
) -> None:
    """Run CMD with cwd = a private copy of --workspace; print its output and exit with its status.

    Example: tandem sandbox run --workspace task/ -- python3 test_solution.py
    """
    if workspace is None:
        _fail("--workspace DIR is required (the directory to copy into the sandbox)")
    assert workspace is not None
    if not workspace.is_dir():
        _fail(f"--workspace {str(workspace)!r} is not an existing directory; pass the directory to copy")
    _check_not_inside(workspace)
    _check_copyable(workspace)
    if not cmd:
        _fail("no command given; pass it after `--`, e.g. `tandem sandbox run --workspace . -- python3 -V`")
    assert cmd is not None
    if cmd[0].startswith("-"):  # an option this command does not know, taken as the command's start
        _fail(f"no such option {cmd[0]!r}; see `tandem sandbox run --help`, and put the command after `--`")
    if backend not in ("bwrap", "plain"):
        _fail(f"--backend {backend!r} is unknown; choose bwrap or plain")
    config = SandboxConfig(backend=backend)  # type: ignore[arg-type]
    if timeout is not None:
        if not 0 < timeout < math.inf:
            _fail(f"--timeout must be a finite number of seconds > 0, got {timeout}")
        _check_most("--timeout", timeout)
        config.timeout_s = timeout
    if cpus is not None:
        if not 0 < cpus < math.inf:
            _fail(f"--cpus must be a finite number of CPUs > 0 (e.g. 0.5), got {cpus}")
        _check_most("--cpus", cpus)
        config.cpus = cpus
    for flag, value, name in (
        ("--memory", memory, "memory_mb"),
        ("--pids", pids, "pids"),
        ("--max-output", max_output, "max_output_bytes"),
    ):
        if value is not None:
            if value <= 0:
                _fail(f"{flag} must be a positive integer, got {value}")
            if flag == "--memory" and value < SANDBOX_MIN_MEMORY_MB:
                _fail(
                    f"--memory must be at least {SANDBOX_MIN_MEMORY_MB} MB (below it sh and python3 cannot "
                    f"load their libraries), got {value}"
                )
            if flag == "--pids" and backend == "bwrap" and value < SANDBOX_MIN_BWRAP_PIDS:
                _fail(
                    f"--pids must be at least {SANDBOX_MIN_BWRAP_PIDS} with the bwrap backend (bwrap and the "
                    f"sandbox's init are processes too; with fewer no command starts), got {value}"
                )
            _check_most(flag, value)
            setattr(config, name, value)
    try:
        with create_sandbox(workspace, config) as sb:
            result = sb.exec(list(cmd))
    except SandboxDiskFull as e:  # the command's own output first, then why the sandbox failed
        if e.result is not None:
            sys.stdout.write(e.result.stdout)
            sys.stdout.flush()
            sys.stderr.write(e.result.stderr)
        _fail(str(e))
        return
    except TandemError as e:
        _fail(str(e))
        return
    except OSError as e:  # e.g. a workspace file this user cannot read, no room for the copy, no free pids
        where = f"{e.strerror}: {e.filename}" if e.strerror and e.filename else str(e)
        _fail(f"the sandbox for --workspace {str(workspace)!r} could not be created or run ({where})")
        return
    sys.stdout.write(result.stdout)
    sys.stdout.flush()
    sys.stderr.write(result.stderr)
    if not result.timed_out and (result.exit_code == 128 + 9 or "MemoryError" in result.stderr):
        sys.stderr.write(
            f"[tandem sandbox: command was stopped, out of memory or processes "
            f"(limits: {config.memory_mb} MB, {config.pids} processes)]\n"
        )
    sys.stderr.flush()
    raise typer.Exit(result.exit_code)

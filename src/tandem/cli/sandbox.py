"""`tandem sandbox run`: run one command in a sandbox holding a private copy of a directory.

Invariants: the command's stdout and stderr are printed on ours and its exit status is ours (124 on timeout,
128+N when killed by signal N); the directory itself is never modified. ``--timeout``, ``--memory`` (MB),
``--pids`` and ``--max-output`` (bytes per stream, cut with a visible marker) override the ``SandboxConfig``
defaults; a command killed by SIGKILL or failing with MemoryError gets a note on stderr naming the limits.
Bad input (missing directory, empty command, unknown backend, unusable bwrap, a limit <= 0) prints one
``error:`` line naming the flag or value and exits with status 2.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Annotated

import typer

from tandem.core.config import SandboxConfig
from tandem.core.errors import TandemError
from tandem.sandbox import create_sandbox

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
    if not cmd:
        _fail("no command given; pass it after `--`, e.g. `tandem sandbox run --workspace . -- python3 -V`")
    assert cmd is not None
    if backend not in ("bwrap", "plain"):
        _fail(f"--backend {backend!r} is unknown; choose bwrap or plain")
    config = SandboxConfig(backend=backend)  # type: ignore[arg-type]
    if timeout is not None:
        if not 0 < timeout < math.inf:
            _fail(f"--timeout must be a finite number of seconds > 0, got {timeout}")
        config.timeout_s = timeout
    for flag, value, name in (
        ("--memory", memory, "memory_mb"),
        ("--pids", pids, "pids"),
        ("--max-output", max_output, "max_output_bytes"),
    ):
        if value is not None:
            if value <= 0:
                _fail(f"{flag} must be a positive integer, got {value}")
            setattr(config, name, value)
    try:
        with create_sandbox(workspace, config) as sb:
            result = sb.exec(list(cmd))
    except TandemError as e:
        _fail(str(e))
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

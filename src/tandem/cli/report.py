"""`tandem report compare`: finished runs side by side (``tandem.orchestrator.compare``).

Invariant: bad input (fewer than 2 runs, a directory without ``metrics.jsonl``, an unreadable, non-UTF-8,
malformed or out-of-range ``metrics.jsonl``, ``config.toml`` or eval JSON, a wrong number of ``--label``, an
``--out`` that cannot be written) prints one ``error:`` line naming the file (and line) or option and what to
do, exits with status 2, and writes nothing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from tandem.orchestrator.compare import CompareError, compare_runs

app = typer.Typer(
    help="Reports over finished run directories.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)


@app.callback()
def _group() -> None:
    """Reports over finished run directories."""


@app.command()
def compare(
    run_dirs: Annotated[list[Path], typer.Argument(help="Two or more run directories of `tandem train`.")],
    out: Annotated[Path, typer.Option(help="Directory for compare.md, compare.json and the PNG plots.")],
    label: Annotated[
        list[str] | None,
        typer.Option(help="Name of each run in the plots, in order (default: what differs in config.toml)."),
    ] = None,
) -> None:
    """Runs side by side: one plot per metric (reward, mismatch KL, routing agreement, ...) and a table."""
    try:
        path = compare_runs(run_dirs, out, label)
    except CompareError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    typer.echo(f"comparison: {path}")

"""`tandem report compare`: finished runs side by side (``tandem.orchestrator.compare``); `tandem report
samples`: the sessions a run logged (``tandem.orchestrator.samples``), as text or JSON.

Invariants: `samples` refuses a run directory without a readable ``samples.jsonl`` and options out of range
with one ``error:`` line and status 2. For `compare`, bad input (fewer than 2 runs, a directory without
``metrics.jsonl``, an unreadable, non-UTF-8, malformed or out-of-range ``metrics.jsonl``, ``config.toml`` or
eval JSON, a wrong number of ``--label``, an ``--out`` that cannot be written) prints one ``error:`` line
naming the file (and line) or option and what to do, exits with status 2, and writes nothing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from tandem.orchestrator.compare import CompareError, compare_runs
from tandem.orchestrator.samples import SamplesError, format_session, read_samples, select

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


@app.command()
def samples(
    run_dir: Annotated[Path, typer.Argument(help="A run directory of `tandem train`.")],
    step: Annotated[int | None, typer.Option(help="Only this step's sessions.")] = None,
    truncated: Annotated[
        bool, typer.Option(help="Only sessions a limit ended (turns, tokens, time).")
    ] = False,
    max_reward: Annotated[float | None, typer.Option(help="Only sessions with reward at most this.")] = None,
    last: Annotated[int, typer.Option(help="How many of the matching sessions, the latest (0: all).")] = 3,
    json_: Annotated[bool, typer.Option("--json", help="Print the rows as JSON lines.")] = False,
) -> None:
    """Sessions the run logged (orchestrator.samples_per_step per step), whole: conversation, flags, diff."""
    import json
    import math

    if last < 0:
        typer.echo(f"error: --last {last} must be >= 0 (0: all matching sessions)", err=True)
        raise typer.Exit(2)
    if max_reward is not None and math.isnan(max_reward):
        typer.echo("error: --max-reward nan matches nothing; give a number", err=True)
        raise typer.Exit(2)
    try:
        rows = read_samples(run_dir)
    except SamplesError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    picked = select(rows, step, truncated, max_reward, last)
    if not picked:
        steps = sorted({r["step"] for r in rows})
        span = f"steps {steps[0]}-{steps[-1]}" if steps else "no steps"
        typer.echo(f"no session matches ({len(rows)} logged, {span})", err=True)
        return
    for row in picked:
        typer.echo(json.dumps(row) if json_ else format_session(row) + "\n")

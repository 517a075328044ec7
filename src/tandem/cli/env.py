"""`tandem env list` and `tandem env try`: the task sources, and grading a given solution exactly as RL would.

Invariants:
- ``env try`` grades through ``tandem.env.reward.score`` with the ``reward`` and ``sandbox`` sections of
  ``--config``/``--set`` (the defaults without them; a composite reward with judge criteria calls the judge as
  training would), in a fresh sandbox (protected files restored, hidden tests added, exit code cross-checked),
  on the files an agent's final workspace would hold: the task's workspace, with ``solution.py`` replaced by
  a FILE, or overlaid with a DIR's files read the way a sandbox snapshot reads them (regular UTF-8 text files,
  ``__pycache__`` and symlinks skipped).
- Bad input (unknown task id, missing or unreadable solution path, an invalid config) prints one ``error:``
  line naming the value and exits with status 2; no traceback.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated, Any

import typer

from tandem.core.config import RewardConfig, SandboxConfig, load_config
from tandem.core.errors import TandemError
from tandem.core.records import Reward, Task
from tandem.sandbox.base import LIMIT_NAMES

app = typer.Typer(
    help="Task sources: list them, grade a solution.", no_args_is_help=True, pretty_exceptions_enable=False
)


def _fail(message: str) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(2)


@app.command("list")
def list_(json_: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False) -> None:
    """Task sources with their task counts per split and level."""
    from tandem.env.sources import describe

    info = describe()
    if json_:
        typer.echo(json.dumps(info))
        return
    for name, d in info.items():
        splits = ", ".join(f"{s}={'unbounded' if n is None else n}" for s, n in d["splits"].items())
        typer.echo(f"{name}: {d['kind']}, ids {d['id_format']}; {splits}")
        if "families_per_level" in d:
            levels = ", ".join(f"level {lv}: {n}" for lv, n in d["families_per_level"].items())
            typer.echo(f"  families per level: {levels}")


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        _fail(f"--solution file {str(path)!r} is unreadable ({type(e).__name__}: {e}); pass UTF-8 text")
        raise AssertionError from e  # unreachable: _fail exits


def _dir_files(root: Path) -> dict[str, str]:
    """The regular UTF-8 text files under ``root`` (relative path -> content), as a sandbox snapshot reads."""
    out: dict[str, str] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
        for name in sorted(filenames):
            full = Path(dirpath, name)
            if full.is_symlink() or not full.is_file():
                continue
            try:
                text = full.read_bytes().decode("utf-8")
            except UnicodeDecodeError:
                continue
            except OSError as e:
                _fail(f"--solution file {str(full)!r} is unreadable ({type(e).__name__}: {e})")
            if "\x00" not in text:
                out[str(full.relative_to(root))] = text
    return out


def solution_files(task: Task, solution: Path) -> dict[str, str]:
    """The agent-final files for ``task`` given a solution FILE (solution.py) or DIR (overlay)."""
    from tandem.env.tasks import SOLUTION_FILE

    files = dict(task.workspace)
    if solution.is_dir():
        files.update(_dir_files(solution))
    elif solution.is_file():
        files[SOLUTION_FILE] = _read_text(solution)
    else:
        _fail(f"--solution {str(solution)!r} does not exist; pass a solution.py file or a workspace dir")
    return files


def flags(task: Task, files: dict[str, str], reward: Reward) -> dict[str, bool]:
    """What happened, from the submitted files and the reward's components."""
    from tandem.env.reward import tests_edited

    c = reward.components
    return {
        "tests_edited": tests_edited(task, files),
        "timed_out": bool(c.get("timed_out")),
        "sandbox_error": bool(c.get("sandbox_error")),
        "parse_error": bool(c.get("parse_error")),
        "judge_error": bool(c.get("judge_error")),
        **{f"limit_{name}": bool(c.get(f"limit_{name}")) for name in LIMIT_NAMES},
    }


def grade(
    task_id: str,
    solution: Path,
    reward_config: RewardConfig | None = None,
    sandbox_config: SandboxConfig | None = None,
) -> dict[str, Any]:
    """``{"task", "reward", "components", "flags"}`` for ``solution`` on ``task_id`` (module invariants)."""
    from tandem.env.reward import score
    from tandem.env.tasks import get_task

    try:
        task = get_task(task_id)
    except ValueError as e:
        _fail(str(e))
        raise AssertionError from e  # unreachable: _fail exits
    files = solution_files(task, solution)
    reward = score(task, files, reward_config or RewardConfig(), sandbox_config or SandboxConfig())
    links = _dir_symlinks(solution) if solution.is_dir() else []
    return {
        "task": task.id,
        "reward": reward.value,
        "components": reward.components,
        "flags": {**flags(task, files, reward), "symlinks_ignored": bool(links)},
    }


def _dir_symlinks(root: Path) -> list[str]:
    """Relative paths of the symlinks under ``root`` (never followed: grading sees none of them)."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            if Path(dirpath, name).is_symlink():
                out.append(str(Path(dirpath, name).relative_to(root)))
    return sorted(out)


@app.command("try")
def try_(
    task_id: Annotated[str, typer.Argument(help="e.g. humaneval:HumanEval/0 or builtin:heldout:s0:l1:0")],
    solution: Annotated[
        Path | None, typer.Option(help="A solution.py file, or a directory overlaid on the task's workspace.")
    ] = None,
    json_: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    config: Annotated[
        Path | None, typer.Option(help="A run config TOML file: its reward and sandbox sections grade.")
    ] = None,
    set_: Annotated[
        list[str] | None, typer.Option("--set", help="Override a config field: key=value.")
    ] = None,
) -> None:
    """Grade a solution of TASK_ID exactly as RL would (fresh sandbox, hidden tests, the run's reward)."""
    if solution is None:
        _fail("--solution FILE_OR_DIR is required")
        return
    try:
        cfg = load_config(config, set_)
    except TandemError as e:
        _fail(str(e))
        return
    out = grade(task_id, solution, cfg.reward, cfg.sandbox)
    if json_:
        typer.echo(json.dumps(out))
        return
    typer.echo(f"task: {out['task']}\nreward: {out['reward']}")
    typer.echo("flags: " + (", ".join(k for k, v in out["flags"].items() if v) or "none"))
    for key, value in sorted(out["components"].items()):
        typer.echo(f"  {key}: {value}")

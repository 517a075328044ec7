"""`tandem env list` and `tandem env try`: the task sources, and grading a given solution exactly as RL would.

Invariants:
- ``env try`` grades through ``tandem.env.reward.score`` with the ``reward`` and ``sandbox`` sections of
  ``--config``/``--set`` (the defaults without them; a composite reward with judge criteria calls the judge as
  training would), in a fresh sandbox (protected files restored, hidden tests added, exit code cross-checked),
  on the files an agent's final workspace would hold: the task's workspace, with ``solution.py`` replaced by
  a FILE, or overlaid with a DIR's files read the way a sandbox snapshot reads them (regular UTF-8 text files,
  ``__pycache__`` and binary files skipped, symlinks never followed: their targets are never opened).
- The snapshot's caps hold for what is read: a file over ``sandbox.file_mb`` MiB, a DIR with over
  ``SNAPSHOT_MAX_BYTES`` of text or over ``SOLUTION_MAX_ENTRIES`` entries is refused (not silently cut, so
  what is graded is what was passed), before any sandbox starts.
- Bad input (unknown task id, missing, unreadable, non-regular or oversized solution path, one on a kernel
  pseudo file system such as ``/proc``, an invalid config)
  prints one ``error:`` line naming the value and exits with status 2; no traceback.
"""

from __future__ import annotations

import errno
import json
import os
import stat
from pathlib import Path
from typing import Annotated, Any

import typer

from tandem.core.config import RewardConfig, RunConfig, SandboxConfig, load_config
from tandem.core.errors import TandemError
from tandem.core.pseudofs import pseudo_filesystems
from tandem.core.records import Reward, Task
from tandem.sandbox.base import LIMIT_NAMES, SNAPSHOT_MAX_BYTES
from tandem.sandbox.limits import MIB

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


SOLUTION_MAX_ENTRIES = 10_000
"""Most files and directories a ``--solution`` DIR may hold (a task workspace holds a few): the walk stops
and refuses past it (``--solution /`` walked the whole host)."""


def _read_regular(path: Path, limit: int, follow: bool) -> bytes | None:
    """The bytes of ``path`` if it is a regular file (None for anything else: a FIFO, a device, and with
    ``follow`` False a symlink, whose target is never opened). More than ``limit`` bytes is refused naming
    ``sandbox.file_mb``, the cap a sandbox snapshot applies per file."""
    flags = os.O_RDONLY | os.O_NONBLOCK | (0 if follow else os.O_NOFOLLOW)
    try:
        # Nothing but a regular file is opened: opening a device can act (a tty, a watchdog, a tape).
        if not stat.S_ISREG((os.stat if follow else os.lstat)(path).st_mode):
            return None
        fd = os.open(path, flags)
    except OSError as e:
        if e.errno == errno.ELOOP and not follow:
            return None  # it became a symlink since the lstat (O_NOFOLLOW): never followed
        _fail(f"--solution file {str(path)!r} is unreadable ({type(e).__name__}: {e})")
        raise AssertionError from e  # unreachable: _fail exits
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):  # replaced since the stat
            return None
        data = f.read(limit + 1)
    if data is None:  # a "regular" file with nothing to read yet (O_NONBLOCK): had been a TypeError traceback
        _fail(f"--solution file {str(path)!r} is unreadable (reading it would block)")
        raise AssertionError  # unreachable: _fail exits
    if len(data) > limit:
        _fail(
            f"--solution file {str(path)!r} is over {limit // MIB} MiB, the largest file a sandbox snapshot "
            f"keeps (sandbox.file_mb={limit // MIB}); pass a smaller file, or raise it with --set "
            "sandbox.file_mb=N"
        )
    return data


def _read_text(path: Path, limit: int) -> str:
    raw = _read_regular(path, limit, follow=True)
    if raw is None:
        _fail(
            f"--solution {str(path)!r} is not a regular file or a directory; pass a solution.py file or a "
            "workspace dir"
        )
    assert raw is not None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        _fail(f"--solution file {str(path)!r} is unreadable ({type(e).__name__}: {e}); pass UTF-8 text")
        raise AssertionError from e  # unreachable: _fail exits


def _count_entries(root: Path, seen: int, more: int) -> int:
    """``seen + more``, refused past ``SOLUTION_MAX_ENTRIES``."""
    if seen + more > SOLUTION_MAX_ENTRIES:
        _fail(
            f"--solution {str(root)!r} holds more than {SOLUTION_MAX_ENTRIES} files and directories; a "
            "solution is a task workspace, pass that directory"
        )
    return seen + more


def _count_bytes(root: Path, seen: int, more: int) -> int:
    """``seen + more`` bytes of text, refused past ``SNAPSHOT_MAX_BYTES``."""
    if seen + more > SNAPSHOT_MAX_BYTES:
        _fail(
            f"--solution {str(root)!r} holds more than {SNAPSHOT_MAX_BYTES // MIB} MiB of text files, the "
            "most a sandbox snapshot keeps (tandem.sandbox.base.SNAPSHOT_MAX_BYTES); pass a smaller directory"
        )
    return seen + more


def _check_ordinary(path: Path, pseudo: dict[int, str], follow: bool) -> None:
    """Refuse ``path`` when it is on a kernel pseudo file system (``core.pseudofs``): its
    "regular" files are not data (``--solution /proc`` ended in a TypeError traceback, and a read of
    ``/proc/kmsg`` takes the kernel's log messages from the system's logger)."""
    try:
        st = (os.stat if follow else os.lstat)(path)
    except OSError:
        return  # gone or unreachable: the read names what is wrong
    kind = pseudo.get(st.st_dev)
    if kind is not None and (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):  # devices: refused later
        _fail(
            f"--solution {str(path)!r} is on a {kind} file system (kernel files, which can block, act or "
            "never end when read, not a solution); pass a solution.py file or a workspace dir of ordinary "
            "files"
        )


def _utf8(name: str) -> bool:
    """Whether ``name`` is valid UTF-8 on disk (``os.walk`` gives other bytes as surrogate escapes)."""
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _dir_files(root: Path, limit: int) -> tuple[dict[str, str], list[str]]:
    """The regular UTF-8 text files under ``root`` (relative path -> content) read the way a sandbox
    snapshot reads them (sorted walk, ``__pycache__`` and binary files and names that are not UTF-8 skipped:
    one such name had made the whole grading a sandbox error, reward 0; symlinks never followed),
    and the relative paths of the symlinks left out. Past a snapshot's caps (``limit`` bytes per file,
    ``SNAPSHOT_MAX_BYTES`` in all) or ``SOLUTION_MAX_ENTRIES``, it refuses instead of leaving files out."""
    out: dict[str, str] = {}
    links: list[str] = []
    total = entries = 0
    pseudo = pseudo_filesystems()
    for dirpath, dirnames, filenames in os.walk(root):
        _check_ordinary(Path(dirpath), pseudo, follow=dirpath == str(root))
        entries = _count_entries(root, entries, len(dirnames) + len(filenames))
        links += [str(Path(dirpath, d).relative_to(root)) for d in dirnames if Path(dirpath, d).is_symlink()]
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")  # os.walk never enters the links
        for name in sorted(filenames):
            full = Path(dirpath, name)
            if not _utf8(str(full.relative_to(root))):  # a snapshot skips such names: so must grading here
                continue
            raw = _read_regular(full, limit, follow=False)
            if raw is None:
                if full.is_symlink():
                    links.append(str(full.relative_to(root)))
                continue
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                continue
            if "\x00" in text:
                continue
            total = _count_bytes(root, total, len(raw))
            out[str(full.relative_to(root))] = text
    return out, sorted(links)


def solution_files(task: Task, solution: Path, limit: int) -> tuple[dict[str, str], list[str]]:
    """The agent-final files for ``task`` given a solution FILE (solution.py) or DIR (overlay), and the
    symlinks of a DIR left out; ``limit`` is the per-file cap in bytes (``sandbox.file_mb``)."""
    from tandem.env.tasks import SOLUTION_FILE

    files = dict(task.workspace)
    links: list[str] = []
    if solution.is_dir():
        overlay, links = _dir_files(solution, limit)
        files.update(overlay)
    elif solution.exists():
        _check_ordinary(solution, pseudo_filesystems(), follow=True)
        files[SOLUTION_FILE] = _read_text(solution, limit)
    else:
        _fail(f"--solution {str(solution)!r} does not exist; pass a solution.py file or a workspace dir")
    return files, links


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
    sandbox_config = sandbox_config or SandboxConfig()
    files, links = solution_files(task, solution, sandbox_config.file_mb * MIB)
    reward = score(task, files, reward_config or RewardConfig(), sandbox_config)
    return {
        "task": task.id,
        "reward": reward.value,
        "components": reward.components,
        "flags": {**flags(task, files, reward), "symlinks_ignored": bool(links)},
    }


def _load_config(config: Path | None, set_: list[str] | None) -> RunConfig:
    """``load_config`` with its refusals (bad values, a missing, non-UTF-8 or unreadable file, a number past
    Python's digit limit: all ``ConfigError``) turned into one ``error:`` line."""
    try:
        return load_config(config, set_)
    except TandemError as e:  # also an unreadable file or value (core.config.load_config names it)
        _fail(str(e))
    raise AssertionError  # unreachable: _fail exits


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
    cfg = _load_config(config, set_)
    out = grade(task_id, solution, cfg.reward, cfg.sandbox)
    if json_:
        typer.echo(json.dumps(out))
        return
    typer.echo(f"task: {out['task']}\nreward: {out['reward']}")
    typer.echo("flags: " + (", ".join(k for k, v in out["flags"].items() if v) or "none"))
    for key, value in sorted(out["components"].items()):
        typer.echo(f"  {key}: {value}")

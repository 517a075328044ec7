"""The agent's five tools, executed in a sandbox: read_file, write_file, run, run_tests, submit.

Invariants:
- ``execute_tool`` never raises for anything the agent sends: an unknown tool, missing, extra or wrongly
  typed arguments, a path outside the workspace or a sandbox failure become a ``ToolResult`` with
  ``error=True`` and a short observation naming the problem.
- Observations are short (the context is tiny): command output keeps its last ``MAX_OBSERVATION`` characters
  and ends with an ``[exit N]`` (or ``[timed out]``) line; ``format_output`` is the only formatter, so the
  scripted expert can produce byte-identical observations without a sandbox.
- Protected files (the visible tests) cannot be written; they are restored before scoring anyway.
"""

from __future__ import annotations

import json
import posixpath
from dataclasses import dataclass
from typing import Any

from tandem.core.errors import SandboxError
from tandem.core.records import Task

MAX_OBSERVATION = 400
MAX_FILE_CHARS = 20_000
MAX_READ = 1000

# name -> argument names (all strings)
TOOL_ARGS: dict[str, tuple[str, ...]] = {
    "read_file": ("path",),
    "write_file": ("path", "content"),
    "run": ("command",),
    "run_tests": (),
    "submit": (),
}
SUBMITTED = "submitted"


@dataclass
class ToolResult:
    """A tool call's observation text, whether it was an error, and whether it ended the session."""

    content: str
    error: bool = False
    submitted: bool = False


def _err(msg: str) -> ToolResult:
    return ToolResult(f"error: {msg}", error=True)


def trim(text: str, limit: int = MAX_OBSERVATION) -> str:
    """Keep the last ``limit`` characters of ``text``, marking the cut."""
    return text if len(text) <= limit else "[...]" + text[-(limit - 5) :]


def format_output(stdout: str, stderr: str, exit_code: int, timed_out: bool = False) -> str:
    """The observation of a command: combined output (trimmed to its tail) and a status line."""
    text = stdout.rstrip("\n")
    err = stderr.rstrip("\n")
    if err:
        text = f"{text}\n{err}" if text else err
    status = "[timed out]" if timed_out else f"[exit {exit_code}]"
    return f"{trim(text)}\n{status}" if text else status


def read_message(content: str) -> str:
    """The observation of read_file: the file's first ``MAX_READ`` characters, marking a cut."""
    return content if len(content) <= MAX_READ else content[:MAX_READ] + "[...]"


def wrote_message(path: str, content: str) -> str:
    return f"wrote {len(content)} chars to {path}"


def check_path(path: str) -> str | None:
    """An error message if ``path`` is not a plain relative path inside the workspace, else None."""
    if not path or "\x00" in path:
        return f"bad path {path!r}: give a relative file path like solution.py"
    if path.startswith("/") or path.startswith("~"):
        return f"path {path!r} is absolute; give a path relative to the workspace, like solution.py"
    norm = posixpath.normpath(path)
    if norm == ".." or norm.startswith("../") or norm == ".":
        return f"path {path!r} escapes the workspace; give a path inside it, like solution.py"
    return None


def _text(x: Any) -> str:
    return x.decode("utf-8", "replace") if isinstance(x, bytes) else str(x or "")


def _exec(sandbox: Any, cmd: list[str], timeout_s: float | None = None) -> ToolResult:
    try:
        res = sandbox.exec(cmd) if timeout_s is None else sandbox.exec(cmd, timeout_s=timeout_s)
    except Exception as e:  # noqa: BLE001 - a sandbox failure is an observation, not a crash
        return _err(f"command failed to run: {type(e).__name__}: {e}")
    return ToolResult(
        format_output(_text(res.stdout), _text(res.stderr), int(res.exit_code), bool(res.timed_out))
    )


def parse_arguments(call: dict[str, Any]) -> tuple[str, dict[str, Any]] | ToolResult:
    """Validate a call's name and arguments; return ``(name, arguments)`` or an error result."""
    if not isinstance(call, dict):
        return _err(f"a tool call must be an object with name and arguments, got {type(call).__name__}")
    name = call.get("name")
    if name not in TOOL_ARGS:
        return _err(f"unknown tool {name!r}; tools are {', '.join(TOOL_ARGS)}")
    args = call.get("arguments", {})
    if args is None:
        args = {}
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            return _err(f"{name}: arguments are not valid JSON ({e.msg})")
    if not isinstance(args, dict):
        return _err(f"{name}: arguments must be an object, got {type(args).__name__}")
    want = TOOL_ARGS[name]
    missing = [a for a in want if a not in args]
    extra = sorted(a for a in args if a not in want)
    if missing:
        return _err(f"{name}: missing argument {', '.join(missing)}; it takes ({', '.join(want)})")
    if extra:
        return _err(f"{name}: unexpected argument {', '.join(extra)}; it takes ({', '.join(want)})")
    for a in want:
        if not isinstance(args[a], str):
            return _err(f"{name}: argument {a} must be a string, got {type(args[a]).__name__}")
    return name, args


def execute_tool(
    sandbox: Any, task: Task, call: dict[str, Any], timeout_s: float | None = None
) -> ToolResult:
    """Run one tool call in ``sandbox`` for ``task``; never raises (see module invariants). ``timeout_s``
    shortens a command's time limit below the sandbox's (what is left of the session's wall time)."""
    parsed = parse_arguments(call)
    if isinstance(parsed, ToolResult):
        return parsed
    name, args = parsed
    if name == "submit":
        return ToolResult(SUBMITTED, submitted=True)
    if name == "run_tests":
        return _exec(sandbox, list(task.visible_test_command), timeout_s)
    if name == "run":
        if not args["command"].strip():
            return _err("run: command is empty; give a bash command like `python3 test_solution.py`")
        return _exec(sandbox, ["bash", "-c", args["command"]], timeout_s)
    path = args["path"]
    if (msg := check_path(path)) is not None:
        return _err(f"{name}: {msg}")
    path = posixpath.normpath(path)
    try:
        if name == "read_file":
            return ToolResult(read_message(_text(sandbox.read(path))))
        if path in task.protected:
            return _err(f"write_file: {path} is protected (a task file); edit solution.py instead")
        if len(args["content"]) > MAX_FILE_CHARS:
            return _err(
                f"write_file: content has {len(args['content'])} chars, the limit is {MAX_FILE_CHARS}"
            )
        sandbox.write(path, args["content"])
        return ToolResult(wrote_message(path, args["content"]))
    except SandboxError as e:  # its message names the path and the fix
        return _err(f"{name}: {e}")
    except FileNotFoundError:
        return _err(f"{name}: no file {path!r} in the workspace")
    except IsADirectoryError:
        return _err(f"{name}: {path!r} is a directory, not a file")
    except OSError as e:  # its strerror only: str(e) would show the sandbox's host path to the agent
        return _err(f"{name} {path!r} failed: {type(e).__name__}: {e.strerror or 'error'}")
    except Exception as e:  # noqa: BLE001 - any sandbox error becomes an observation
        return _err(f"{name} {path!r} failed: {type(e).__name__}: {e}")

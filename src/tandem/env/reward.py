"""Verified rewards: run a task's hidden tests against the agent's final files in a fresh sandbox.

Invariants:
- Scoring never reuses the agent's sandbox: a fresh one is built from the agent's final files, with the
  task's protected files restored from ``task.workspace`` and the hidden tests written last (so an agent
  file of the same name cannot replace them).
- The test output's last ``RESULT passed=P total=N`` line is parsed and cross-checked: all tests count as
  passed only if the exit status is 0 and (when the task records it) ``N`` equals the number of hidden tests;
  an exit status of 0 with fewer passes, or a non-zero status with "all passed", is capped below full marks.
  Unparseable output, a timeout or a sandbox failure scores 0.
- ``score`` never raises because of what the agent wrote; every outcome is a ``Reward`` whose components
  say what happened (tests_passed, tests_total, pass_fraction, exit_code, timed_out, parse_error,
  sandbox_error, tool_errors, truncated, tool_error_penalty).
- Known limit: tests run in the same process as the agent's code, so code crafted to print a forged RESULT
  line and exit 0 could fool the parser; the expected-total check makes that a deliberate act, not an
  accident.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from tandem.core.config import RewardConfig, SandboxConfig
from tandem.core.records import Reward, Task

log = logging.getLogger(__name__)
RESULT_RE = re.compile(r"^RESULT passed=(\d+) total=(\d+)\s*$", re.MULTILINE)


def scoring_files(task: Task, files: dict[str, str]) -> dict[str, str]:
    """The files of the scoring sandbox: the agent's files, protected files restored, hidden tests added."""
    out = {p: c for p, c in files.items() if isinstance(p, str) and isinstance(c, str)}
    for p in task.protected:
        if p in task.workspace:
            out[p] = task.workspace[p]
        else:
            out.pop(p, None)
    out.update(task.hidden_tests)
    return out


def parse_result(stdout: str) -> tuple[int, int] | None:
    """``(passed, total)`` from the last RESULT line, or None when there is none or it is inconsistent."""
    found = RESULT_RE.findall(stdout)
    if not found:
        return None
    passed, total = int(found[-1][0]), int(found[-1][1])
    return (passed, total) if 0 <= passed <= total and total > 0 else None


def score(
    task: Task,
    files: dict[str, str],
    config: RewardConfig,
    sandbox_config: SandboxConfig,
    tool_errors: int = 0,
    truncated: bool = False,
) -> Reward:
    """Score the agent's final ``files`` for ``task`` (see module invariants); never raises on agent code."""
    from tandem.sandbox import create_sandbox

    comps: dict[str, float] = {
        "tests_passed": 0.0,
        "tests_total": float(task.meta.get("hidden_total", 0)),
        "pass_fraction": 0.0,
        "exit_code": -1.0,
        "timed_out": 0.0,
        "parse_error": 0.0,
        "sandbox_error": 0.0,
        "tool_errors": float(tool_errors),
        "truncated": float(bool(truncated)),
        "tool_error_penalty": config.tool_error_penalty * tool_errors,
    }
    result: Any = None
    try:
        with create_sandbox(scoring_files(task, files), sandbox_config) as sandbox:
            result = sandbox.exec(list(task.test_command))
    except Exception as e:  # noqa: BLE001 - e.g. an agent file the sandbox refuses; scored as a failure
        log.warning("scoring %s: sandbox failed: %s: %s", task.id, type(e).__name__, e)
        comps["sandbox_error"] = 1.0
    if result is not None:
        comps["exit_code"] = float(result.exit_code)
        comps["timed_out"] = float(bool(result.timed_out))
        parsed = None if result.timed_out else parse_result(result.stdout)
        expected = task.meta.get("hidden_total")
        if parsed is not None and expected is not None and parsed[1] != int(expected):
            parsed = None  # the runner always reports the hidden test count; anything else is not its output
        if parsed is None:
            comps["parse_error"] = float(not result.timed_out)
        else:
            passed, total = parsed
            all_ok = passed == total and result.exit_code == 0
            if passed == total and not all_ok:
                passed = total - 1  # "all passed" without exit status 0 is not all passed
            comps["tests_passed"], comps["tests_total"] = float(passed), float(total)
            comps["pass_fraction"] = passed / total
            comps["all_passed"] = float(all_ok)
    comps.setdefault("all_passed", 0.0)
    base = comps["pass_fraction"] if config.kind == "fraction" else comps["all_passed"]
    return Reward(base - comps["tool_error_penalty"], comps)

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
  say what happened (tests_passed, tests_total, pass_fraction, f2p_fraction, p2p_fraction, exit_code,
  timed_out, parse_error, sandbox_error, tool_errors, truncated, tool_error_penalty, tests_edited,
  test_edit_penalty).
- Test edits: ``tests_edited`` is 1.0 when the agent's final files change, add or delete a protected file
  (the visible tests) or hold a file whose name is a hidden test's (in any directory). Grading ignores such
  edits either way (protected files are restored, hidden tests written last); then
  ``RewardConfig.test_edit_penalty`` is subtracted, but never takes the reward below 0 (the component
  ``test_edit_penalty`` records the amount applied).
- The RESULT line is the hidden-test runner's alone: built-in tasks and HumanEval run the agent's code in a
  child process whose stdout is a private channel to the runner (the agent's prints go to stderr); the
  runner makes itself non-dumpable (no other process can open its stdout or memory) and deletes its own file
  before the child starts. A forged RESULT line, an early exit or a flood of output cannot produce a pass.
- Limits: every limit the grading command ran into is a component ``limit_<name>`` = 1 (names in
  ``tandem.sandbox.base.LIMIT_NAMES``). Hitting the memory, pids, CPU or file-size limit, or leaving a
  process running, also sets ``limit_violation`` and zeroes ``pass_fraction`` and ``all_passed`` (so a fork
  bomb, a memory bomb, an endless loop or a daemon never earns test reward, whatever the runner printed).
- Known limit: a task whose test command runs the agent's code in its own process (none of the built-in
  sources) is only protected by the expected-total and exit-status cross-checks.
- Composite rewards (``RewardConfig.terms`` non-empty): the base reward is the sum over terms of
  ``weight * component`` for terms whose gates (``component >= threshold``) are all open, else 0; the
  penalties above then apply unchanged. With ``terms`` empty (the default) nothing changes: the base is
  ``pass_fraction`` or ``all_passed`` as ``kind`` says, and no judge is called. Components added: each term's
  part ``term.<component>``, their sum ``composite``, and with judge criteria ``judge.<name>`` (score in
  [0, 1]), ``judge.<name>.error`` (1 when its judge call failed, scoring it 0), ``judge`` (the criteria's
  weighted mean), ``judge_error`` (1 when any call failed), ``judge_calls`` (criteria judged),
  ``judge_requests`` (HTTP requests, retries included) and ``judge_skipped`` (criteria not judged).
- The judge (``tandem.env.judge``) is called only for criteria whose score can matter, after the tests:
  first the criteria named by gates of terms whose test gates are open, then the criteria of terms whose
  gates are all open. A criterion whose every term is gated shut is not judged and scores 0 (a term of
  weight 0 still is judged: that is how a score is logged without counting). Judge failures never raise.
"""

from __future__ import annotations

import difflib
import logging
import re
from collections.abc import Callable
from pathlib import PurePosixPath
from typing import TYPE_CHECKING, Any

from tandem.core.config import RewardConfig, RewardGate, SandboxConfig
from tandem.core.records import Reward, Task

if TYPE_CHECKING:
    from tandem.env.judge import Verdict

log = logging.getLogger(__name__)
VIOLATIONS = frozenset({"memory", "pids", "cpu", "file_size", "leftover_processes"})
"""Sandbox limits (``tandem.sandbox.base.LIMIT_NAMES``) whose hit during grading zeroes the test score; a
timeout already scores 0 and the output cap only cuts what the agent printed."""
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


def tests_edited(task: Task, files: dict[str, str]) -> bool:
    """Whether ``files`` change a protected file of ``task`` or hold a file named like a hidden test."""
    if any(files.get(p) != task.workspace.get(p) for p in task.protected):
        return True
    hidden = {PurePosixPath(p).name for p in task.hidden_tests}
    return any(isinstance(p, str) and PurePosixPath(p).name in hidden for p in files)


DIFF_FILE_MAX_CHARS = 1 << 18
"""A file larger than this (either side) is named in a diff, not diffed: ``difflib`` on a probe's 15 MiB
rewrite of a protected test took 3.4 s on the rollout's event loop."""
DIFF_MAX_CHARS = 1 << 20
"""A trajectory's diff is cut at this many characters, with a marker (that probe's diff held 17 million)."""


def workspace_diff(before: dict[str, str], after: dict[str, str]) -> str:
    """Unified diff of ``after`` vs ``before`` (``a/``, ``b/`` paths; ``/dev/null``: added or deleted), at
    most ``DIFF_MAX_CHARS`` characters; files over ``DIFF_FILE_MAX_CHARS`` get one line naming them."""
    out: list[str] = []
    size = 0
    for path in sorted(set(before) | set(after)):
        old, new = before.get(path), after.get(path)
        if old == new:
            continue
        if size > DIFF_MAX_CHARS:
            break
        if max(len(old or ""), len(new or "")) > DIFF_FILE_MAX_CHARS:
            n_old, n_new = len(old) if old is not None else "no", len(new) if new is not None else "no"
            out.append(f"diff of {path} omitted: {n_old} -> {n_new} characters (over {DIFF_FILE_MAX_CHARS})")
            out[-1] += "\n"
            size += len(out[-1])
            continue
        start = len(out)
        out.extend(
            difflib.unified_diff(
                (old or "").splitlines(keepends=True),
                (new or "").splitlines(keepends=True),
                "/dev/null" if old is None else f"a/{path}",
                "/dev/null" if new is None else f"b/{path}",
            )
        )
        if out and not out[-1].endswith("\n"):
            out[-1] += "\n\\ No newline at end of file\n"
        size += sum(len(line) for line in out[start:])
    text = "".join(out)
    if len(text) > DIFF_MAX_CHARS:
        text = text[:DIFF_MAX_CHARS] + f"\n[diff cut at {DIFF_MAX_CHARS} characters]\n"
    return text


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
        "tests_edited": float(tests_edited(task, files)),
        "test_edit_penalty": 0.0,
        **dict.fromkeys(task.meta.get("result_components", ()), 0.0),
    }
    result: Any = None
    try:
        sandbox = create_sandbox(scoring_files(task, files), sandbox_config)
        try:
            result = sandbox.exec(list(task.test_command), last=True)
        finally:
            sandbox.close(wait=False)  # every process is dead now; unmount and deletion go to the reaper
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
            if task.meta.get("result_components"):  # counts the task's grader reports, e.g. f2p/p2p
                from tandem.env.repo_grader import result_components

                parts = result_components(task, result.stdout)
                comps.update(parts)
                if not _parts_add_up(parts, *parsed):  # not the grader's own output: score nothing
                    comps["parse_error"] = 1.0
                    comps["tests_passed"] = comps["pass_fraction"] = comps["all_passed"] = 0.0
        for name in result.limits:
            comps[f"limit_{name}"] = 1.0
        if set(result.limits) & VIOLATIONS:  # graded work must stay within its limits to earn anything
            comps["limit_violation"] = 1.0
            comps["pass_fraction"] = comps["all_passed"] = 0.0
    comps.setdefault("all_passed", 0.0)
    comps["f2p_fraction"], comps["p2p_fraction"] = _issue_fractions(comps)
    if config.terms:
        base = composite(config, comps, lambda names: _judge(task, files, names, config))
    else:
        base = comps["pass_fraction"] if config.kind == "fraction" else comps["all_passed"]
    value = base - comps["tool_error_penalty"]
    if comps["tests_edited"]:
        comps["test_edit_penalty"] = min(config.test_edit_penalty, max(value, 0.0))
        value -= comps["test_edit_penalty"]
    return Reward(value, comps)


def _issue_fractions(comps: dict[str, float]) -> tuple[float, float]:
    """(f2p_fraction, p2p_fraction): a repository task's FAIL_TO_PASS and PASS_TO_PASS pass fractions from
    its grader's components; for a task without them, all hidden tests are fail-to-pass (``pass_fraction``)
    and none must keep passing (1). Both 0 when grading failed (no result, forged output, a limit broken)."""
    graded = comps["tests_total"] > 0 and not (
        comps["parse_error"] or comps["sandbox_error"] or comps["timed_out"] or comps.get("limit_violation")
    )
    if not graded or comps["exit_code"] < 0:
        return 0.0, 0.0
    if "f2p_total" not in comps or "p2p_total" not in comps:
        return comps["pass_fraction"], 1.0
    f2p_passed = comps["f2p_passed"]
    every = f2p_passed == comps["f2p_total"] and comps["p2p_passed"] == comps["p2p_total"]
    if every and not comps["all_passed"]:
        f2p_passed -= 1  # "all passed" without exit status 0 is not all passed (as for pass_fraction)
    f2p = max(f2p_passed, 0.0) / comps["f2p_total"] if comps["f2p_total"] else 1.0
    p2p = comps["p2p_passed"] / comps["p2p_total"] if comps["p2p_total"] else 1.0
    return f2p, p2p


def _parts_add_up(parts: dict[str, float], passed: int, total: int) -> bool:
    """Whether a grader's ``*_passed``/``*_total`` components (e.g. f2p and p2p) sum to its RESULT line's
    counts, as the grader's own output always does (a cross-check against forged output)."""
    groups = {n[: -len("_passed")] for n in parts if n.endswith("_passed") and f"{n[:-7]}_total" in parts}
    if not groups:  # e.g. a grader reporting only lint_passed: nothing to cross-check
        return True
    got = sum(parts.get(f"{g}_passed", 0.0) for g in groups)
    of = sum(parts.get(f"{g}_total", 0.0) for g in groups)
    return got == passed and of == total


def _judge(task: Task, files: dict[str, str], names: list[str], config: RewardConfig) -> dict[str, Verdict]:
    from tandem.env.judge import judge_criteria

    changed = {p: c for p, c in files.items() if task.workspace.get(p) != c}
    return judge_criteria(task, workspace_diff(task.workspace, files), changed, names, config)


def composite(
    config: RewardConfig, comps: dict[str, float], judge: Callable[[list[str]], dict[str, Verdict]]
) -> float:
    """The composite base reward of ``config.terms`` over the test components in ``comps``, calling
    ``judge(criterion names) -> verdicts`` only for criteria whose score can matter (module invariants);
    adds the term, composite and judge components to ``comps``."""
    verdicts: dict[str, Verdict] = {}

    def run(names: list[str]) -> None:
        todo = [n for n in dict.fromkeys(names) if n not in verdicts]
        if todo:
            got = judge(todo)
            verdicts.update({n: got[n] for n in todo if n in got})

    def value(component: str) -> float:
        if component == "judge":
            total = sum(c.weight for c in config.criteria)
            mean = sum(c.weight * value(f"judge.{c.name}") for c in config.criteria) / total if total else 0.0
            return mean
        if component.startswith("judge."):
            v = verdicts.get(component[6:])
            return v.score if v is not None else 0.0
        return comps[component]

    def is_open(gate: RewardGate) -> bool:
        return value(gate.component) >= gate.threshold

    # Test gates first (free), then the judge criteria those gates leave in play, then the terms' own.
    maybe = [
        t for t in config.terms if all(is_open(g) for g in t.gates if not config.criteria_for(g.component))
    ]
    run([n for t in maybe for g in t.gates for n in config.criteria_for(g.component)])
    live = [t for t in maybe if all(is_open(g) for g in t.gates)]
    run([n for t in live for n in config.criteria_for(t.component)])

    total = 0.0
    for t in config.terms:
        part = t.weight * value(t.component) if any(t is x for x in live) else 0.0
        comps[f"term.{t.component}"] = part
        total += part
    comps["composite"] = total
    if config.criteria:
        for c in config.criteria:
            v = verdicts.get(c.name)
            comps[f"judge.{c.name}"] = v.score if v is not None else 0.0
            comps[f"judge.{c.name}.error"] = float(bool(v is not None and v.error))
        comps["judge"] = value("judge")
        comps["judge_error"] = float(any(v.error for v in verdicts.values()))
        comps["judge_calls"] = float(len(verdicts))
        comps["judge_requests"] = float(sum(v.attempts for v in verdicts.values()))
        comps["judge_skipped"] = float(len(config.criteria) - len(verdicts))
    return total

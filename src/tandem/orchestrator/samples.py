"""``samples.jsonl``: a few sessions of every training step, whole, and reading them back.

Invariants:
- ``sample_rows`` picks a step's sessions by position only (round-robin over its groups), never by reward,
  so the file is an unbiased look at what the policy does; each row is plain JSON (see
  ``tandem.orchestrator.metrics`` for what a row holds).
- ``read_samples`` refuses (``SamplesError``, naming the file and line) a missing file, one that is not UTF-8,
  and a line that is not a JSON object with a ``step``; it never returns a partial list silently. A last line
  cut short by a crash is the one exception: it is skipped, as the run wrote everything before it whole.
- A step repeated after a resume keeps only its later rows (the ones the resumed run trained on).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tandem.core.errors import TandemError
from tandem.core.records import Group

TOOL_ARGS_CHARS = 300
"""A tool call's arguments are shown up to this many characters (``format_session``); the file has all."""


class SamplesError(TandemError):
    """``samples.jsonl`` cannot be read; the message names the file (and line) and what to do."""


def sample_rows(step: int, groups: list[Group], limit: int) -> list[dict[str, Any]]:
    """Up to ``limit`` sessions of a step's ``groups`` as ``samples.jsonl`` rows, taken round-robin: each
    group's first session in group order, then each group's second, and so on, so a step's samples span
    its tasks before they repeat one. Which sessions is fixed by the batch's order, never by their reward."""
    picked = []
    depth = max((len(g.trajectories) for g in groups), default=0)
    for i in range(depth):
        for gi, g in enumerate(groups):
            if i < len(g.trajectories) and len(picked) < limit:
                picked.append((gi, i, g.trajectories[i]))
    return [
        {
            "step": step,
            "group": gi,
            "index": i,
            "task_id": t.task_id,
            "sampled_by": t.oldest_version(),
            "sampled_tokens": t.num_sampled,
            "reward": t.reward.value,
            "components": dict(t.reward.components),
            "flags": dict(t.flags),
            "tool_stats": dict(t.tool_stats),
            "timings": dict(t.timings),
            "messages": [m.to_dict() for m in t.messages],
            "diff": t.diff,
        }
        for gi, i, t in picked
    ]


def read_samples(run_dir: Path) -> list[dict[str, Any]]:
    """The rows of ``run_dir/samples.jsonl`` in the order written, a resumed run's in place of the steps it
    repeated (see module invariants)."""
    path = Path(run_dir) / "samples.jsonl"
    if not path.is_file():
        raise SamplesError(
            f"{path} does not exist: pass a run directory of `tandem train` that logged sessions "
            "(orchestrator.samples_per_step > 0; runs before 2026-12-03 did not)"
        )
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise SamplesError(f"{path} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    rows: list[dict[str, Any]] = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            if n == len(lines):  # cut short by a crash mid-write: everything before it is whole
                break
            raise SamplesError(
                f"{path}:{n}: not JSON ({e.msg}): the line is damaged (a run killed mid-write, then resumed, "
                "leaves its torn row there); the other lines are whole: remove that one"
            ) from None
        if not isinstance(row, dict) or not isinstance(row.get("step"), int):
            raise SamplesError(f"{path}:{n}: not a session row (a JSON object with an integer step)")
        rows.append(row)
    kept: list[dict[str, Any]] = []
    for row in rows:
        # A step's rows start at group 0, session 0; one that starts again at a step already written is a
        # resumed run writing it anew, so the rows from that step on are replaced.
        starts = row.get("group") == 0 and row.get("index") == 0
        if kept and (row["step"] < kept[-1]["step"] or starts and row["step"] == kept[-1]["step"]):
            kept = [r for r in kept if r["step"] < row["step"]]
        kept.append(row)
    return kept


def select(
    rows: list[dict[str, Any]],
    step: int | None = None,
    truncated: bool = False,
    max_reward: float | None = None,
    last: int = 3,
) -> list[dict[str, Any]]:
    """The last ``last`` rows (0: all) of ``step``, only truncated ones, with reward <= ``max_reward``."""
    picked = [
        r
        for r in rows
        if (step is None or r["step"] == step)
        and (not truncated or r.get("flags", {}).get("truncated"))
        and (max_reward is None or float(r.get("reward", 0.0)) <= max_reward)
    ]
    return picked[-last:] if last else picked


def format_session(row: dict[str, Any]) -> str:
    """One session as text: a header (step, task, reward, the flags set, tool statistics), each message
    with its role and tool calls, then the agent's diff."""
    flags = [k for k, v in sorted(row.get("flags", {}).items()) if v]
    stats = ", ".join(f"{k} {v}" for k, v in row.get("tool_stats", {}).items())
    comps = row.get("components", {})
    shown = {k: comps[k] for k in ("pass_fraction", "tests_passed", "tests_total") if k in comps}
    out = [
        f"=== step {row['step']}, group {row.get('group')}, session {row.get('index')}: {row.get('task_id')}",
        f"reward {row.get('reward')} {json.dumps(shown)}; sampled by version {row.get('sampled_by')}, "
        f"{row.get('sampled_tokens')} tokens",
        f"flags: {', '.join(flags) or 'none'}; {stats}",
    ]
    for m in row.get("messages", []):
        name = f" {m['name']}" if m.get("name") else ""
        out.append(f"--- {m.get('role')}{name}")
        content = m.get("content")
        if content:
            out.append(content if isinstance(content, str) else json.dumps(content))
        for call in m.get("tool_calls") or []:
            args = json.dumps(call.get("arguments"), ensure_ascii=False)
            if len(args) > TOOL_ARGS_CHARS:
                args = args[:TOOL_ARGS_CHARS] + f"... ({len(args)} characters)"
            out.append(f"-> {call.get('name')}({args})")
    out.append("--- diff")
    out.append(row.get("diff") or "(no change to the workspace)")
    return "\n".join(out)

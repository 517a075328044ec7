"""Quick sanity check of a base model on held-out built-in tasks (not the real harness; see tandem.env).

Samples whole sessions with HF ``generate`` at temperature 1.0, executes the tool calls against an in-memory
workspace (tests run as subprocesses with a timeout), and scores the submitted solution on the hidden tests.
Prints the well-formed tool-call rate (turns with >= 1 call and no parse error) and the solve rate.

    .venv/bin/python models/sanity_check.py models/tandem-base --tasks 30
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from tandem.core.records import Message
from tandem.env.tasks import SOLUTION_FILE, TOOLS, task_split
from tandem.env.tools import SUBMITTED, format_output, read_message, wrote_message
from tandem.model.load import load_chat_format, load_model


def run_py(files: dict[str, str], test_name: str, test_src: str) -> tuple[str, int]:
    with tempfile.TemporaryDirectory() as d:
        for k, v in {**files, test_name: test_src}.items():
            (Path(d) / k).write_text(v)
        try:
            p = subprocess.run([sys.executable, test_name], cwd=d, capture_output=True, text=True, timeout=5)
            return format_output(p.stdout, p.stderr, p.returncode), p.returncode
        except subprocess.TimeoutExpired:
            return "[timed out]", 124


def session(model, chat, task, max_turns: int, max_tokens: int, verbose: bool = False) -> dict:
    files = dict(task.workspace)
    ids = chat.render_prompt(task.prompt, TOOLS)
    turns = good = 0
    submitted = False
    for _ in range(max_turns):
        if len(ids) >= max_tokens:
            break
        with torch.no_grad():
            out = model.generate(
                torch.tensor([ids]),
                do_sample=True,
                temperature=1.0,
                top_p=1.0,
                max_new_tokens=min(192, max_tokens - len(ids)),
                eos_token_id=chat.stop_token_ids,
                pad_token_id=chat.eos_token_id,
            )
        new = out[0, len(ids) :].tolist()
        ids += new
        turns += 1
        _, calls, errors = chat.parse_assistant(new)
        if verbose:
            print(repr(chat.tokenizer.decode(new)), errors, file=sys.stderr)
        good += bool(calls) and not errors
        obs = []
        for c in calls:
            a, n = c["arguments"], c["name"]
            if n == "read_file":
                p = str(a.get("path", ""))
                obs.append(read_message(files[p]) if p in files else f"error: no such file {p}")
            elif n == "write_file":
                files[str(a.get("path", ""))] = str(a.get("content", ""))
                obs.append(wrote_message(str(a.get("path", "")), str(a.get("content", ""))))
            elif n == "run_tests":
                obs.append(run_py(files, "test_solution.py", task.workspace["test_solution.py"])[0])
            elif n == "submit":
                submitted = True
                obs.append(SUBMITTED)
            else:
                obs.append(f"error: tool {n} not available here")
        if submitted:
            break
        if not calls:
            obs.append("error: your reply contained no tool call")
        ids += chat.render_continuation([Message("tool", o) for o in obs])
    hidden_name, hidden_src = next(iter(task.hidden_tests.items()))
    solved = run_py({SOLUTION_FILE: files[SOLUTION_FILE]}, hidden_name, hidden_src)[1] == 0
    return {"turns": turns, "well_formed": good, "submitted": submitted, "solved": solved}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default="models/tandem-base")
    ap.add_argument("--tasks", type=int, default=30)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--verbose", action="store_true", help="print every sampled turn to stderr")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    model, _ = load_model(args.model)
    chat = load_chat_format(args.model)
    res = [session(model, chat, t, 6, 1024, args.verbose) for t in task_split("heldout", 0, [1, 2, 3], args.tasks)]
    turns = sum(r["turns"] for r in res)
    summary = {
        "tasks": len(res),
        "turns": turns,
        "well_formed_turn_rate": sum(r["well_formed"] for r in res) / max(1, turns),
        "submit_rate": sum(r["submitted"] for r in res) / len(res),
        "solve_rate": sum(r["solved"] for r in res) / len(res),
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()

"""An agent harness written only against the OpenAI API, as a team's production harness would be.

tandem trains it unchanged: a rollout runs this script inside the task's sandbox with ``OPENAI_BASE_URL``
pointing at tandem's gateway, ``OPENAI_API_KEY`` and ``TANDEM_SESSION`` set, and the task's workspace as the
working directory. The agent has three tools, ``shell``, ``write_file`` and ``submit``; the task statement
comes in ``TANDEM_TASK`` (or ``TASK.md``).

Run by hand against any OpenAI-compatible server:
    OPENAI_BASE_URL=http://127.0.0.1:8000/v1 OPENAI_API_KEY=x python examples/openai_harness.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from openai import OpenAI

MAX_TURNS = int(os.environ.get("HARNESS_MAX_TURNS", os.environ.get("TANDEM_MAX_TURNS", "6")))
MAX_TOKENS = int(os.environ.get("HARNESS_MAX_TOKENS", "192"))
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "shell",
            "description": "Run a shell command in the workspace; returns its output.",
            "parameters": {
                "type": "object",
                "properties": {"command": {"type": "string", "description": "the command"}},
                "required": ["command"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "write_file",
            "description": "Write a file in the workspace.",
            "parameters": {
                "type": "object",
                "properties": {
                    "path": {"type": "string", "description": "relative path"},
                    "content": {"type": "string", "description": "full new content"},
                },
                "required": ["path", "content"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "submit",
            "description": "Submit the workspace; ends the session.",
            "parameters": {"type": "object", "properties": {}},
        },
    },
]


def shell(command: str) -> str:
    try:
        p = subprocess.run(command, shell=True, capture_output=True, text=True, timeout=10)
    except subprocess.TimeoutExpired:
        return "error: the command timed out"
    out = (p.stdout + p.stderr)[-2000:]
    return f"{out}[exit {p.returncode}]"


def write_file(path: str, content: str) -> str:
    full = os.path.realpath(path)
    if not full.startswith(os.getcwd() + os.sep):
        return "error: the path must stay inside the workspace"
    os.makedirs(os.path.dirname(full), exist_ok=True)
    with open(full, "w") as f:
        f.write(content)
    return f"wrote {len(content)} characters to {path}"


def run_tool(name: str, args: dict) -> str:
    if name == "shell":
        return shell(str(args.get("command", "")))
    if name == "write_file":
        return write_file(str(args.get("path", "")), str(args.get("content", "")))
    return f"error: unknown tool {name!r}; use shell, write_file or submit"


def main() -> int:
    client = OpenAI()  # OPENAI_BASE_URL and OPENAI_API_KEY come from the environment
    session = os.environ.get("TANDEM_SESSION", "")
    task = os.environ.get("TANDEM_TASK") or (open("TASK.md").read() if os.path.exists("TASK.md") else "")
    messages: list[dict] = [
        {"role": "system", "content": "You are a coding agent. Use the tools; call submit when done."},
        {"role": "user", "content": task},
    ]
    for _ in range(MAX_TURNS):
        reply = client.chat.completions.create(
            model=os.environ.get("OPENAI_MODEL", "tandem"),
            messages=messages,
            tools=TOOLS,
            max_tokens=MAX_TOKENS,
            temperature=1.0,
            extra_headers={"X-Tandem-Session": session},
        )
        msg = reply.choices[0].message
        calls = msg.tool_calls or []
        entry: dict = {"role": "assistant", "content": msg.content or ""}
        if calls:
            entry["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.function.name, "arguments": c.function.arguments},
                }
                for c in calls
            ]  # sent back exactly as received: the gateway then reuses the model's own tokens
        messages.append(entry)
        if reply.choices[0].finish_reason == "length":
            return 0
        if not calls:  # a call the model got wrong comes back as its text in content
            wrong = "<tool_call>" in (msg.content or "")
            nudge = "That tool call is not valid JSON; write it again." if wrong else "Call a tool."
            messages.append({"role": "user", "content": nudge})
            continue
        for c in calls:
            if c.function.name == "submit":
                return 0
            try:
                args = json.loads(c.function.arguments or "{}")
            except json.JSONDecodeError as e:
                args, result = None, f"error: arguments are not JSON ({e})"
            if args is not None:
                result = run_tool(c.function.name, args)
            messages.append({"role": "tool", "tool_call_id": c.id, "content": result})
    return 0


if __name__ == "__main__":
    sys.exit(main())

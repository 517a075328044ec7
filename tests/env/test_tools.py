"""Agent tools: real sandbox execution, argument validation, short observations, never raising."""

from __future__ import annotations

import pytest

from tandem.core.config import SandboxConfig
from tandem.env.tasks import generate_task
from tandem.env.tools import MAX_OBSERVATION, SUBMITTED, execute_tool, format_output
from tandem.sandbox import bwrap_available, create_sandbox


@pytest.fixture(scope="module")
def task():
    return generate_task("train", 0, 0, 1)


@pytest.fixture()
def sb(task):
    cfg = SandboxConfig(backend="bwrap" if bwrap_available() else "plain", timeout_s=2.0)
    with create_sandbox(task.workspace, cfg) as s:
        yield s


def test_read_write_run_tests_submit(sb, task) -> None:
    r = execute_tool(sb, task, {"name": "read_file", "arguments": {"path": "solution.py"}})
    assert not r.error and r.content == task.workspace["solution.py"]
    src = task.meta["solution"]
    r = execute_tool(sb, task, {"name": "write_file", "arguments": {"path": "solution.py", "content": src}})
    assert not r.error and r.content == f"wrote {len(src)} chars to solution.py"
    assert sb.read("solution.py") == src
    r = execute_tool(sb, task, {"name": "run_tests", "arguments": {}})
    assert not r.error and r.content.endswith("RESULT passed=2 total=2\n[exit 0]")
    r = execute_tool(sb, task, {"name": "submit", "arguments": "{}"})  # JSON-string arguments work too
    assert r == type(r)(SUBMITTED, error=False, submitted=True)


def test_run_command_output_and_timeout(sb, task) -> None:
    r = execute_tool(sb, task, {"name": "run", "arguments": {"command": "echo hi; echo oops >&2; exit 3"}})
    assert not r.error and r.content == "hi\noops\n[exit 3]"
    r = execute_tool(sb, task, {"name": "run", "arguments": {"command": "python3 -c \"print('x' * 5000)\""}})
    assert len(r.content) <= MAX_OBSERVATION + len("\n[exit 0]") and r.content.startswith("[...]")
    r = execute_tool(sb, task, {"name": "run", "arguments": {"command": "sleep 30"}})
    assert r.content.endswith("[timed out]")


@pytest.mark.parametrize(
    ("call", "needle"),
    [
        ({"name": "delete_file", "arguments": {}}, "unknown tool 'delete_file'"),
        ({"name": "read_file", "arguments": {}}, "missing argument path"),
        (
            {"name": "read_file", "arguments": {"path": "solution.py", "mode": "r"}},
            "unexpected argument mode",
        ),
        ({"name": "write_file", "arguments": {"path": "a.py", "content": 3}}, "content must be a string"),
        ({"name": "run", "arguments": "{not json"}, "not valid JSON"),
        ({"name": "run", "arguments": ["ls"]}, "arguments must be an object"),
        ({"name": "run", "arguments": {"command": "  "}}, "command is empty"),
        ({"name": "read_file", "arguments": {"path": "../etc/passwd"}}, "escapes the workspace"),
        ({"name": "read_file", "arguments": {"path": "/etc/passwd"}}, "is absolute"),
        ({"name": "read_file", "arguments": {"path": "missing.py"}}, "missing.py"),
        ({"name": "write_file", "arguments": {"path": "test_solution.py", "content": ""}}, "protected"),
        ("not a dict", "must be an object"),
    ],
)
def test_bad_calls_are_error_observations(sb, task, call, needle: str) -> None:
    r = execute_tool(sb, task, call)
    assert r.error and not r.submitted
    assert r.content.startswith("error: ") and needle in r.content


def test_closed_sandbox_is_an_observation(task) -> None:
    cfg = SandboxConfig(backend="bwrap" if bwrap_available() else "plain")
    s = create_sandbox(task.workspace, cfg)
    s.close()
    r = execute_tool(s, task, {"name": "run_tests", "arguments": {}})
    assert r.error and "closed" in r.content


def test_format_output() -> None:
    assert format_output("", "", 0) == "[exit 0]"
    assert format_output("a\n", "b\n", 1) == "a\nb\n[exit 1]"
    assert format_output("x", "", 124, timed_out=True) == "x\n[timed out]"


def test_failed_file_calls_do_not_show_the_sandboxs_host_path(sb, task) -> None:
    """The OS's error names the host path of the workspace (``/dev/shm/tandem-sbx-...``): the agent gets
    its own path and the reason only, the same observation in every sandbox."""
    calls = [
        {"name": "write_file", "arguments": {"path": "solution.py/x.py", "content": "1"}},
        {"name": "write_file", "arguments": {"path": "a" * 300, "content": "x"}},
        {"name": "read_file", "arguments": {"path": "b" * 300}},
    ]
    for call in calls:
        r = execute_tool(sb, task, call)
        assert r.error and call["arguments"]["path"] in r.content, r.content
        assert str(sb.workdir) not in r.content and "/dev/shm" not in r.content, r.content

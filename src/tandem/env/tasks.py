"""Built-in tasks: procedurally generated Python function-writing exercises at three difficulty levels.

Each instance (of a family in ``tandem.env.families``) asks for one function ``solve(args)`` in
``solution.py``; the agent sees a stub and 2 visible tests (``test_solution.py``); 6-10 hidden tests (edge
cases included) run only when scoring. The instance's parameters (``K``, ``M``, ``C``, ``W``) live in a
protected ``params.py`` that the stub imports (``from params import K``), and the spec names them
(``return x plus K``). Neither the function name nor a parameter value has to be copied from the context
into the code: the default 6M-parameter model cannot yet copy an arbitrary name or number reliably, and
copying carries no information about the task; a model that can still may write the literal value.

Invariants:
- Generation is a pure function of ``(split, seed, level, index)``: ``get_task(task.id)`` rebuilds the same
  task, byte for byte, in any process.
- Train and held-out splits are disjoint by construction, for every seed: an instance's split is decided by
  a hash of its content signature (family, parameters, instance nonce; the nonce seeds the test inputs),
  which does not involve the seed. No instance is in both splits; a held-out instance may share its family
  and parameters with train instances and differ in its test inputs.
- Tasks of a family with parameters have ``params.py`` (one ``NAME = repr(value)`` line per parameter,
  sorted) in their workspace and in ``protected``: scoring restores it, so editing it cannot change what
  the hidden tests expect. Solutions, bugs and the stub are the same text for every instance of a family.
- ``meta["solution"]`` passes every hidden test; every entry of ``meta["bugs"]`` fails at least one (bug
  templates that happen to be correct for an instance's parameters are dropped at generation time).
- Test files print ``PASS <call>`` / ``FAIL <call>: <detail>`` per test and a last line
  ``RESULT passed=P total=N``; they exit 0 only when all pass; an import failure of solution.py fails all.
  Visible tests import nothing but ``sys`` and ``solution`` so workspace files cannot shadow what they use.
- The hidden tests (``python3 -I -S _hidden_test.py``: no workspace import can shadow the grader's) print the
  same lines, but the solution runs in a child process: the grader sends each call, the child evaluates it
  and replies with the value's repr on a private pipe (its own prints go to stderr), the grader compares
  (``ast.literal_eval``; same type and value). Before starting the child the grader makes itself
  non-dumpable and deletes its own file, so the RESULT line and the expected values are the grader's alone.
- Everything is short: a whole expert session fits in about 1400 characters (a 1024-token context).
"""

from __future__ import annotations

import builtins
import functools
import hashlib
import io
import random
import types
from typing import Any

from tandem.core.config import TaskConfig
from tandem.core.records import Message, Task, TaskLimits
from tandem.env.families import FAMILIES_BY_LEVEL, LEVELS, Args, Family
from tandem.env.grader_src import CHILD_END

SYSTEM_PROMPT = (
    "You are a coding agent. Tools: read_file(path), write_file(path, content), run(command), "
    "run_tests(), submit(). Call one tool per turn."
)


def _tool(name: str, desc: str, **props: str) -> dict[str, Any]:
    params = {
        "type": "object",
        "properties": {k: {"type": "string", "description": v} for k, v in props.items()},
    }
    params["required"] = list(props)
    params["additionalProperties"] = False
    return {"type": "function", "function": {"name": name, "description": desc, "parameters": params}}


TOOLS: list[dict[str, Any]] = [
    _tool("read_file", "Read a workspace file.", path="relative path"),
    _tool("write_file", "Write a workspace file.", path="relative path", content="full new content"),
    _tool("run", "Run a bash command in the workspace.", command="bash command"),
    _tool("run_tests", "Run the visible tests."),
    _tool("submit", "Submit the workspace for scoring; ends the session."),
]

SOLUTION_FILE = "solution.py"
PARAMS_FILE = "params.py"
VISIBLE_TEST_FILE = "test_solution.py"
HIDDEN_TEST_FILE = "_hidden_test.py"
HELDOUT_FRACTION = 0.2
N_VISIBLE = 2
N_HIDDEN = 8
MAX_VISIBLE_ARGS_CHARS = 20


RUNNER = """p = 0
try:
    import solution
    err = None
except BaseException as e:
    err = f"{type(e).__name__}: {e}"
    print(f"FAIL import solution: {err}"[:160])
for c, w in C:
    if err:
        break
    try:
        g = eval(c, vars(solution))
        ok = type(g) is type(w) and g == w
        d = f"got {g!r}, want {w!r}"
    except BaseException as e:
        ok, d = False, f"{type(e).__name__}: {e}"
    p += ok
    print(f"PASS {c}" if ok else f"FAIL {c}: {d}"[:160])
print(f"RESULT passed={p} total={len(C)}")
sys.exit(0 if p == len(C) else 1)
"""


# The hidden-test grader: the same checks and output as RUNNER, but the solution runs in a child process.
# Its stdout (the one the reward parses) is written by this process alone; see the module invariants.
HIDDEN_RUNNER = (
    CHILD_END
    + """import ast, os, subprocess
try:
    import ctypes
    ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE=0: other processes cannot open our fds or memory
except Exception:
    pass
here = os.path.dirname(os.path.abspath(__file__))
try:
    os.unlink(os.path.abspath(__file__))  # from here on the expected values exist only in this process
except OSError:
    pass
CHILD = '''import os, sys
channel = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)
sys.stdout = sys.stderr
def send(tag, text):
    channel.write(tag + text.replace(chr(10), " ") + chr(10))
    channel.flush()
try:
    import solution
    ns = vars(solution)
    send("K", "")
except BaseException as e:
    send("E", f"{type(e).__name__}: {e}")
    sys.exit(1)
PLAIN = (int, float, complex, str, bytes, bool, type(None), list, tuple, dict, set, frozenset)
for line in sys.stdin:
    try:
        g = eval(line, ns)
        send("R" if type(g) in PLAIN else "T", repr(g))
    except BaseException as e:
        send("X", f"{type(e).__name__}: {e}")
'''
class Names(ast.NodeTransformer):
    def visit_Name(self, node):
        if node.id in ("inf", "nan"):
            return ast.copy_location(ast.Constant(float(node.id)), node)
        if node.id in ("set", "frozenset"):
            return node
        raise ValueError("not a literal: " + node.id)
def decode(text):
    return ast.literal_eval(Names().visit(ast.parse(text.strip(), mode="eval")))
ended = False
def receive():
    global ended
    line = child.stdout.readline()
    if not line:
        ended = True
        raise EOFError("the solution process ended")
    return line[0], line[1:].rstrip(chr(10))
child = subprocess.Popen(
    [sys.executable, "-S", "-c", CHILD], cwd=here, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
)
p = 0
try:
    tag, err = receive()
    err = None if tag == "K" else err
except BaseException as e:
    err = f"{type(e).__name__}: {e}"
if err:
    print(f"FAIL import solution: {err}"[:160])
for c, w in C:
    if err:
        break
    try:
        child.stdin.write(c + chr(10))
        child.stdin.flush()
        tag, d = receive()
        ok = False
        if tag == "R":
            g = decode(d)
            ok = type(g) is type(w) and g == w
            d = f"got {g!r}, want {w!r}"
        elif tag == "T":
            d = f"got {d}, want {w!r}"
    except BaseException as e:
        ok, d = False, f"{type(e).__name__}: {e}"
    p += ok
    print(f"PASS {c}" if ok else f"FAIL {c}: {d}"[:160])
died = reap(child, ended)
print(f"RESULT passed={p} total={len(C)}")
reraise(died)
sys.exit(0 if p == len(C) else 1)
"""
)


class _Symbol(str):
    """A parameter's name standing in for its value in a template: ``{K}`` and ``{C!r}`` both give ``K``."""

    def __repr__(self) -> str:
        return str(self)


def _symbols(params: dict[str, Any]) -> dict[str, _Symbol]:
    return {k: _Symbol(k) for k in params}


def params_source(params: dict[str, Any]) -> str:
    """The ``params.py`` of an instance (see module invariants)."""
    return "".join(f"{k} = {v!r}\n" for k, v in sorted(params.items()))


def _function_source(
    name: str, args: str, body: str, doc: str | None = None, params: dict[str, Any] | None = None
) -> str:
    lines = [f"from params import {', '.join(sorted(params))}", "", ""] if params else []
    lines.append(f"def {name}({args}):")
    if doc is not None:
        lines.append(f'    """{doc}"""')
    lines += ["    " + ln for ln in body.split("\n")]
    return "\n".join(lines) + "\n"


def _call(name: str, args: Args) -> str:
    return f"{name}({', '.join(repr(a) for a in args)})"


def workspace_modules(workspace: dict[str, str]) -> dict[str, str]:
    """The importable helper modules of a task's workspace (``params.py``) as ``{module name: source}``."""
    return {p[:-3]: src for p, src in workspace.items() if p == PARAMS_FILE}


def _module(name: str, source: str, builtins_ns: dict[str, Any]) -> types.ModuleType:
    """Execute ``source`` as module ``name`` with builtins ``builtins_ns`` (its imports go through them)."""
    mod = types.ModuleType(name)
    mod.__file__ = f"{name}.py"
    vars(mod)["__builtins__"] = builtins_ns
    exec(_compile(source, mod.__file__), vars(mod))
    return mod


def _importing(modules: dict[str, str], base: dict[str, Any] | None = None) -> dict[str, Any]:
    """A builtins namespace whose ``__import__`` serves ``modules`` from source (trusted code only)."""
    b = dict(base if base is not None else vars(builtins))
    outer = b["__import__"]

    def _import(name: str, *a: Any, **kw: Any) -> Any:
        if name in modules:
            return _module(name, modules[name], b)
        return outer(name, *a, **kw)

    b["__import__"] = _import
    return b


def _outputs(source: str, name: str, cases: list[Args], modules: dict[str, str]) -> list[Any]:
    """Outputs of ``name`` from ``source`` per case, or a unique failure marker where it raises."""
    ns: dict[str, Any] = {"__builtins__": _importing(modules)}
    exec(_compile(source, SOLUTION_FILE), ns)
    out: list[Any] = []
    for a in cases:
        try:
            out.append(ns[name](*[_copy(x) for x in a]))
        except Exception as e:  # noqa: BLE001 - a raising bug variant simply fails that case
            out.append(("<raised>", type(e).__name__))
    return out


def _copy(x: Any) -> Any:
    return list(x) if isinstance(x, list) else x


def _same(a: Any, b: Any) -> bool:
    return type(a) is type(b) and a == b


def test_file(cases: list[tuple[str, Any]], runner: str = RUNNER) -> str:
    """The source of a test file over ``(call, expected)`` pairs (the runner of the module docstring)."""
    rows = "".join(f"    ({c!r}, {w!r}),\n" for c, w in cases)
    return f"import sys\n\nC = [\n{rows}]\n{runner}"


def hidden_test_file(cases: list[tuple[str, Any]]) -> str:
    """The hidden-test grader over ``(call, expected)`` pairs (out-of-process; see module invariants)."""
    return test_file(cases, HIDDEN_RUNNER)


FUNCTION_NAME = "solve"


def signature(family: Family, params: dict[str, Any], nonce: int) -> str:
    return f"{family.name}|{sorted(params.items())}|{nonce}"


def split_of(sig: str) -> str:
    """``heldout`` for about HELDOUT_FRACTION of signatures, else ``train``; independent of the seed."""
    h = int.from_bytes(hashlib.sha256(sig.encode()).digest()[:8], "big")
    return "heldout" if h / 2**64 < HELDOUT_FRACTION else "train"


@functools.lru_cache(maxsize=4096)
def _compile(source: str, filename: str) -> types.CodeType:
    return compile(source, filename, "exec")


_DEFAULT_TASK_CONFIG = TaskConfig()


def default_limits(config: TaskConfig | None = None) -> TaskLimits:
    """Session limits of a task from the run's task config (defaults when None)."""
    c = config or _DEFAULT_TASK_CONFIG
    return TaskLimits(max_turns=c.max_turns, max_tokens=c.max_tokens, wall_time_s=c.wall_time_s)


def task_id(split: str, seed: int, level: int, index: int) -> str:
    return f"builtin:{split}:s{seed}:l{level}:{index}"


def generate_task(split: str, index: int, seed: int, level: int, limits: TaskLimits | None = None) -> Task:
    """The ``index``-th task of ``level`` in ``split`` for ``seed`` (deterministic; see module invariants)."""
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    if level not in FAMILIES_BY_LEVEL:
        raise ValueError(f"level must be one of {LEVELS}, got {level!r}")
    if index < 0:
        raise ValueError(f"index must be >= 0, got {index}")
    for attempt in range(10_000):
        r = random.Random(f"{seed}:{level}:{split}:{index}:{attempt}")
        fam = r.choice(FAMILIES_BY_LEVEL[level])
        params = fam.params(r)
        name = FUNCTION_NAME
        sig = signature(fam, params, r.randrange(1 << 30))
        if split_of(sig) == split:
            break
    else:  # pragma: no cover - with 20% held-out this is astronomically unlikely
        raise RuntimeError(f"no {split} instance found for level {level}, index {index}")
    visible: list[Args] = []
    hidden: list[Args] = list(fam.edges(params))
    for _ in range(200):
        if len(visible) >= N_VISIBLE and len(hidden) >= N_HIDDEN:
            break
        a = fam.gen(r, params)
        if a in hidden:
            continue
        if len(visible) < N_VISIBLE:
            # Visible cases are short: they appear in run_tests observations inside a tiny context.
            if len(repr(a)) > MAX_VISIBLE_ARGS_CHARS:
                continue
            visible.append(a)
        hidden.append(a)
    sym = _symbols(params)
    modules = {PARAMS_FILE[:-3]: params_source(params)} if params else {}
    solution = _function_source(name, fam.args, fam.body.format(**sym), params=params)
    want_vis = _outputs(solution, name, visible, modules)
    want_hid = _outputs(solution, name, hidden, modules)
    bugs = []
    for tmpl in fam.bugs:
        bug = _function_source(name, fam.args, tmpl.format(**sym), params=params)
        if bug != solution and not all(map(_same, _outputs(bug, name, hidden, modules), want_hid)):
            bugs.append(bug)
    spec = fam.spec.format(**sym)
    doc = spec[0].upper() + spec[1:] + "."
    stub = _function_source(name, fam.args, "raise NotImplementedError", doc, params=params)
    where = f" ({', '.join(sorted(params))} from params.py)" if params else ""
    user = (
        f"Implement `{name}({fam.args})` in solution.py: {spec}{where}. "
        f"Visible tests are in test_solution.py. Call submit when done."
    )
    extra = {PARAMS_FILE: modules["params"]} if params else {}
    return Task(
        id=task_id(split, seed, level, index),
        prompt=[Message("system", SYSTEM_PROMPT), Message("user", user)],
        workspace={
            SOLUTION_FILE: stub,
            VISIBLE_TEST_FILE: test_file(
                [(_call(name, a), w) for a, w in zip(visible, want_vis, strict=True)]
            ),
            **extra,
        },
        hidden_tests={
            HIDDEN_TEST_FILE: hidden_test_file(
                [(_call(name, a), w) for a, w in zip(hidden, want_hid, strict=True)]
            )
        },
        test_command=["python3", "-I", "-S", HIDDEN_TEST_FILE],
        visible_test_command=["python3", "-S", VISIBLE_TEST_FILE],
        protected=[VISIBLE_TEST_FILE, *extra],
        limits=limits or default_limits(),
        meta={
            "family": fam.name,
            "level": level,
            "split": split,
            "seed": seed,
            "index": index,
            "function": name,
            "params": params,
            "signature": sig,
            "solution": solution,
            "bugs": bugs,
            "visible_total": len(visible),
            "hidden_total": len(hidden),
        },
    )


def task_split(
    split: str, seed: int, levels: list[int] | tuple[int, ...], n: int, limits: TaskLimits | None = None
) -> list[Task]:
    """``n`` tasks of ``split``, levels interleaved round-robin (deterministic)."""
    if not levels:
        raise ValueError("levels must not be empty; pass e.g. [1, 2, 3]")
    lv = list(levels)
    return [generate_task(split, i // len(lv), seed, lv[i % len(lv)], limits) for i in range(n)]


def get_task(task_id: str, limits: TaskLimits | None = None) -> Task:
    """Rebuild a task from its id: ``builtin:<split>:s<seed>:l<level>:<index>``, ``humaneval:HumanEval/<n>``
    (from ``tandem.env.humaneval``) or ``repo:<split>:<package>-<bug>`` (from ``tandem.env.repos``)."""
    if task_id.startswith("humaneval:"):
        from tandem.env.humaneval import get_task as humaneval_task

        return humaneval_task(task_id, limits)
    if task_id.startswith("repo:"):
        from tandem.env.repos import get_task as repo_task

        return repo_task(task_id, limits)
    try:
        src, split, s, lv, idx = task_id.split(":")
        if src != "builtin" or s[0] != "s" or lv[0] != "l":
            raise ValueError
        seed, level, index = int(s[1:]), int(lv[1:]), int(idx)
    except (ValueError, IndexError):
        raise ValueError(
            f"task id {task_id!r} is not a task id; expected builtin:<split>:s<seed>:l<level>:<index>, "
            "humaneval:HumanEval/<n> or repo:<split>:<package>-<bug>"
        ) from None
    return generate_task(split, index, seed, level, limits)


class _Exit(Exception):
    def __init__(self, code: int) -> None:
        self.code = code


def run_test_file_inprocess(
    test_source: str, solution_source: str, modules: dict[str, str] | None = None
) -> tuple[str, int]:
    """Run a generated test file against ``solution_source`` in this process: ``(stdout, exit_code)``.

    ``modules``: the workspace's other importable modules (``workspace_modules(task.workspace)``).
    Only for trusted code (reference solutions and bug variants): it emulates ``python3 test_file`` by giving
    the runner a private ``print``, ``import`` and ``sys.exit``. Tests check that it matches a sandboxed run.
    """
    out = io.StringIO()

    def _print(*a: Any, **kw: Any) -> None:
        kw.setdefault("file", out)
        print(*a, **kw)

    def _exit(code: int | None = 0) -> None:
        raise _Exit(int(code or 0))

    def _import(name: str, *a: Any, **kw: Any) -> Any:
        if name == "sys":
            return types.SimpleNamespace(exit=_exit)
        if name == "solution":
            return _module("solution", solution_source, b)
        return builtins.__import__(name, *a, **kw)

    b = _importing(modules or {}, dict(vars(builtins), print=_print, __import__=_import))
    try:
        g = {"__builtins__": b, "__name__": "__main__"}
        if test_source.endswith(HIDDEN_RUNNER):  # the grader's checks and output are RUNNER's
            test_source = test_source[: -len(HIDDEN_RUNNER)] + RUNNER
        if test_source.endswith(RUNNER):
            # Same statements in the same namespace as the whole file; the runner part compiles once.
            exec(compile(test_source[: -len(RUNNER)], VISIBLE_TEST_FILE, "exec"), g)
            exec(_compile(RUNNER, VISIBLE_TEST_FILE), g)
        else:
            exec(compile(test_source, VISIBLE_TEST_FILE, "exec"), g)
        code = 0
    except _Exit as e:
        code = e.code
    return out.getvalue(), code

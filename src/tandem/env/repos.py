"""Repository tasks, SWE-bench style: small packages the project owns, each with one injected bug.

Templates live in ``repo_templates/<package>/``: the reference package (``<package>/*.py``), a README and
``spec.toml`` (the visible test cases, and the bugs: a one-place source edit, an issue text describing the
symptom, and hidden cases that expose it). A task is ``(package, bug)``; its id is
``repo:<split>:<package>-<bug>``.

Invariants:
- A task is a pure function of its template: ``get_task(id)`` rebuilds it byte for byte in any process (on
  the same Python). Expected outcomes are never written by hand: they come from running the reference
  package (``tandem.env.repo_grader.run_cases``).
- The split of a task is decided by a hash of its name (``split_of``), so train and held-out are disjoint by
  construction; asking for a task under the other split raises.
- The repository at its base commit (``task.workspace``) is the buggy package, README, and ``tests/``: the
  package's unittest suite minus any visible case the bug breaks. ``meta["base_commit"]`` is the git sha of
  that tree committed with a fixed author, committer, dates and message (computed here without git;
  ``materialize`` builds the real repository with git and checks it gets the same sha). The agent's
  workspace holds the files only (no ``.git``: workspaces are text files); ``materialize`` is the way to
  get a checkout.
- FAIL_TO_PASS = the bug's hidden cases plus visible cases the bug breaks; generation checks that every
  one passes on the reference and fails on the bug (grader's own verdict). PASS_TO_PASS = the remaining
  visible cases; generation checks that they pass on both. Otherwise generation raises (a template error).
- Grading goes through ``tandem.env.reward.score`` unchanged: the agent's final files (= the base commit
  with the agent's diff applied, deletions included), ``tests/`` restored to the base commit (every file in
  it is ``protected``; edits set ``tests_edited``), then the hidden grader ``_repo_grader.py`` written last
  and run as ``python3 -I -S _repo_grader.py``. It runs FAIL_TO_PASS + PASS_TO_PASS out of process and
  prints the only RESULT line (see ``tandem.env.repo_grader``); ``meta["hidden_total"]`` is their count.
- The grader also prints ``COMPONENT`` lines for ``f2p_passed``, ``f2p_total``, ``p2p_passed`` and
  ``p2p_total`` (named in ``meta["result_components"]``); ``repo_grader.result_components(task, stdout)``
  reads them, for ``reward.score`` to add to the reward's components once the RESULT line is accepted.
"""

from __future__ import annotations

import ast
import copy
import functools
import hashlib
import os
import subprocess
import tempfile
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tandem.core.records import Message, Task, TaskLimits
from tandem.env import repo_grader as rg
from tandem.env.reward import workspace_diff
from tandem.env.tasks import SYSTEM_PROMPT, default_limits

PREFIX = "repo:"
TEMPLATES = Path(__file__).resolve().parent / "repo_templates"
PACKAGES = ("textkit", "intervals", "ledger", "semver")
HELDOUT_FRACTION = 0.25
GRADER_FILE = "_repo_grader.py"
TEST_DIR = "tests"
VISIBLE_TEST_COMMAND = ["python3", "-m", "unittest"]
GIT_AUTHOR = ("tandem", "tandem@example.invalid")
GIT_TIME = 1704067200  # 2024-01-01T00:00:00Z
SPLITS = ("train", "heldout")


@dataclass(frozen=True)
class Bug:
    name: str
    file: str
    old: str
    new: str
    tests: str
    title: str
    issue: str
    cases: dict[str, str]


@dataclass(frozen=True)
class Template:
    name: str
    version: str
    summary: str
    files: dict[str, str]  # the reference package and README (repository paths)
    tests: dict[str, tuple[str, dict[str, str]]]  # test module -> (preamble, {case name: code})
    bugs: tuple[Bug, ...]


@functools.cache
def template(package: str) -> Template:
    """The template of ``package`` (one of PACKAGES), loaded from ``repo_templates``."""
    root = TEMPLATES / package
    spec = tomllib.loads((root / "spec.toml").read_text())
    files = {"README.md": (root / "README.md").read_text()}
    for path in sorted((root / package).glob("*.py")):
        files[f"{package}/{path.name}"] = path.read_text()
    tests = {m: (t.get("preamble", ""), dict(t["cases"])) for m, t in spec["tests"].items()}
    bugs = tuple(
        Bug(b["name"], b["file"], b["old"], b["new"], b["tests"], b["title"], b["issue"].strip(), b["cases"])
        for b in spec["bugs"]
    )
    return Template(spec["name"], spec["version"], spec["summary"], files, tests, bugs)


def split_of(name: str) -> str:
    """``heldout`` for about HELDOUT_FRACTION of task names, else ``train`` (a hash; no seed)."""
    h = int.from_bytes(hashlib.sha256(f"repo|{name}".encode()).digest()[:8], "big")
    return "heldout" if h / 2**64 < HELDOUT_FRACTION else "train"


@functools.cache
def names(split: str) -> tuple[str, ...]:
    """Task names of ``split``: packages interleaved round-robin, bugs in template order."""
    if split not in SPLITS:
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    per_package = [[f"{p}-{b.name}" for b in template(p).bugs] for p in PACKAGES]
    order = [n for row in _round_robin(per_package) for n in row]
    return tuple(n for n in order if split_of(n) == split)


def _round_robin(rows: list[list[str]]) -> list[list[str]]:
    width = max(len(r) for r in rows)
    return [[r[i] for r in rows if i < len(r)] for i in range(width)]


def _split_case(code: str, what: str) -> tuple[str, str]:
    """``(setup, expr)`` of a case: the statements before its last line, and that line (an expression)."""
    lines = code.strip("\n").splitlines()
    setup, expr = "\n".join(lines[:-1]), lines[-1].strip() if lines else ""
    try:
        ast.parse(setup)
        ast.parse(expr, mode="eval")
    except SyntaxError as e:
        raise ValueError(f"{what}: a case is statements ending in a one-line expression ({e})") from None
    return setup, expr


def _apply(files: dict[str, str], bug: Bug, package: str) -> dict[str, str]:
    src = files.get(bug.file)
    if src is None or src.count(bug.old) != 1:
        n = 0 if src is None else src.count(bug.old)
        raise ValueError(f"bug {package}-{bug.name}: `old` occurs {n} times in {bug.file}, not once")
    return {**files, bug.file: src.replace(bug.old, bug.new)}


def git_commit_sha(files: dict[str, str], message: str) -> str:
    """The sha git gives a root commit of ``files`` (mode 100644) with GIT_AUTHOR/GIT_TIME and ``message``."""

    def obj(kind: str, body: bytes) -> bytes:
        return hashlib.sha1(f"{kind} {len(body)}\0".encode() + body).digest()

    def tree(node: dict[str, Any]) -> bytes:
        entries = []
        for name, value in node.items():
            if isinstance(value, dict):
                entries.append((name + "/", b"40000 " + name.encode() + b"\0" + tree(value)))
            else:
                entries.append((name, b"100644 " + name.encode() + b"\0" + obj("blob", value.encode())))
        return obj("tree", b"".join(e for _, e in sorted(entries, key=lambda t: t[0].encode())))

    root: dict[str, Any] = {}
    for path, content in files.items():
        *dirs, leaf = path.split("/")
        node = root
        for d in dirs:
            node = node.setdefault(d, {})
        node[leaf] = content
    who = f"{GIT_AUTHOR[0]} <{GIT_AUTHOR[1]}> {GIT_TIME} +0000"
    body = f"tree {tree(root).hex()}\nauthor {who}\ncommitter {who}\n\n{message}\n"
    return obj("commit", body.encode()).hex()


def commit_message(package: str) -> str:
    t = template(package)
    return f"{t.name} {t.version}"


@functools.cache
def _reference_replies(package: str) -> dict[tuple[str, str], Any]:
    """The reference package's reply to every case of its template (visible and hidden), in one run."""
    t = template(package)
    pairs: list[tuple[str, str]] = []
    for module, (preamble, visible) in t.tests.items():
        codes = list(visible.items()) + [kv for b in t.bugs if b.tests == module for kv in b.cases.items()]
        for cname, code in codes:
            setup, expr = _split_case(code, f"{package} case {cname}")
            pairs.append((preamble.strip("\n") + "\n" + setup, expr))
    pairs = list(dict.fromkeys(pairs))
    return dict(zip(pairs, rg.run_cases(t.files, pairs), strict=True))


@functools.cache
def _build(package: str, bug_name: str) -> dict[str, Any]:
    """Everything of one task but its limits (cached; ``get_task`` copies it)."""
    t = template(package)
    bug = next((b for b in t.bugs if b.name == bug_name), None)
    if bug is None:
        raise ValueError(f"package {package!r} has no bug {bug_name!r}")
    name = f"{package}-{bug.name}"
    if bug.tests not in t.tests:
        raise ValueError(f"bug {name}: tests = {bug.tests!r} is not a test module of {package}")
    buggy = _apply(t.files, bug, package)
    # (module, case name, setup, expr, hidden) over the whole suite, visible cases first per module
    cases: list[tuple[str, str, str, str, bool]] = []
    for module, (_, visible) in t.tests.items():
        for cname, code in visible.items():
            cases.append((module, cname, *_split_case(code, f"{package} test {cname}"), False))
        if module == bug.tests:
            for cname, code in bug.cases.items():
                if cname in visible:
                    raise ValueError(f"bug {name}: hidden case {cname!r} has the name of a visible case")
                cases.append((module, cname, *_split_case(code, f"bug {name} case {cname}"), True))
    setups = [(t.tests[m][0].strip("\n") + "\n" + s, e) for m, _, s, e, _ in cases]
    ref = _reference_replies(package)
    ref_replies, bug_replies = [ref[c] for c in setups], rg.run_cases(buggy, setups)
    rendered: dict[str, list[tuple[str, str, str, rg.Want, bool]]] = {m: [] for m in t.tests}
    grader_cases: list[tuple[str, str, str, str, rg.Want]] = []
    f2p, p2p = [], []
    for (module, cname, setup, expr, hidden), full, ref_reply, got in zip(
        cases, setups, ref_replies, bug_replies, strict=True
    ):
        what = f"{package} {rg.test_id(module, cname)}"
        want = rg.want_of(ref_reply, what)
        if want[0] == "raises" and not rg.exception_visible(want[1], t.tests[module][0]):
            raise ValueError(f"{what}: raises {want[1]}, which the test module's preamble does not import")
        breaks = not rg.verdict(got, want)[0]
        if hidden and not breaks:
            raise ValueError(f"{what}: a hidden case of bug {name} passes on the buggy code")
        tid = rg.test_id(module, cname)
        (f2p if breaks else p2p).append(tid)
        grader_cases.append(("F2P" if breaks else "P2P", tid, *full, want))
        rendered[module].append((cname, setup, expr, want, breaks))
    if not f2p:
        raise ValueError(f"bug {name} has no FAIL_TO_PASS case")
    base_tests, full_tests = {f"{TEST_DIR}/__init__.py": ""}, {}
    for module, rows in rendered.items():
        path, preamble = f"{TEST_DIR}/test_{module}.py", t.tests[module][0]
        base_tests[path] = rg.render_test_file(module, preamble, [r[:4] for r in rows if not r[4]])
        full_tests[path] = rg.render_test_file(module, preamble, [r[:4] for r in rows])
    workspace = {**buggy, **base_tests}
    sha = git_commit_sha(workspace, commit_message(package))
    user = (
        f"The repository `{package}`, {t.summary}, is checked out in the workspace at commit {sha[:12]}. "
        f"Resolve this issue:\n\n### {bug.title}\n\n{bug.issue}\n\n"
        f"Fix the package's code; the existing tests (`{' '.join(VISIBLE_TEST_COMMAND)}`, also run by "
        "run_tests) must keep passing. Do not edit the tests. Call submit when done."
    )
    return {
        "name": name,
        "prompt": [Message("system", SYSTEM_PROMPT), Message("user", user)],
        "workspace": workspace,
        "hidden_tests": {GRADER_FILE: rg.grader_script(grader_cases)},
        "protected": sorted(base_tests),
        "meta": {
            "source": "repo",
            "package": package,
            "bug": bug.name,
            "split": split_of(name),
            "base_commit": sha,
            "issue_title": bug.title,
            "fail_to_pass": f2p,
            "pass_to_pass": p2p,
            "hidden_total": len(f2p) + len(p2p),
            "visible_total": len(p2p),
            "result_components": list(rg.COMPONENTS),
            "fix": {bug.file: t.files[bug.file]},
            "patch": workspace_diff(buggy, t.files),
            "test_patch": workspace_diff(base_tests, {**base_tests, **full_tests}),
        },
    }


def task_id(split: str, name: str) -> str:
    return f"{PREFIX}{split}:{name}"


def make_task(name: str, limits: TaskLimits | None = None) -> Task:
    """The task named ``<package>-<bug>`` (its split is ``split_of(name)``)."""
    package, _, bug = name.partition("-")
    if package not in PACKAGES or not bug:
        raise ValueError(f"{name!r} is not a repository task name; expected <package>-<bug>")
    b = copy.deepcopy(_build(package, bug))
    return Task(
        id=task_id(split_of(name), name),
        prompt=b["prompt"],
        workspace=b["workspace"],
        hidden_tests=b["hidden_tests"],
        test_command=["python3", "-I", "-S", GRADER_FILE],
        visible_test_command=list(VISIBLE_TEST_COMMAND),
        protected=b["protected"],
        limits=limits or default_limits(),
        meta=b["meta"],
    )


def get_task(task_id: str, limits: TaskLimits | None = None) -> Task:
    """The task ``repo:<split>:<package>-<bug>``; ValueError naming the id when there is no such task."""
    parts = task_id.split(":")
    all_names = {n for s in SPLITS for n in names(s)}
    if len(parts) != 3 or parts[0] != PREFIX[:-1] or parts[1] not in SPLITS or parts[2] not in all_names:
        raise ValueError(
            f"task id {task_id!r} is not a repository task id; expected repo:<split>:<package>-<bug> "
            f"(see `tandem env list`), e.g. {PREFIX}{split_of(names('train')[0])}:{names('train')[0]}"
        )
    if split_of(parts[2]) != parts[1]:
        raise ValueError(f"task id {task_id!r}: {parts[2]} is in the {split_of(parts[2])} split")
    return make_task(parts[2], limits)


def task_at(split: str, index: int, limits: TaskLimits | None = None) -> Task:
    """The ``index``-th task of ``split``, cycling (an endless stream wraps around)."""
    if index < 0:
        raise ValueError(f"index must be >= 0, got {index}")
    ns = names(split)
    return make_task(ns[index % len(ns)], limits)


def task_list(split: str, n: int, limits: TaskLimits | None = None) -> list[Task]:
    """The first ``min(n, len(split))`` tasks of ``split``."""
    return [make_task(name, limits) for name in names(split)[: max(0, n)]]


def describe() -> dict[str, Any]:
    """Counts for ``tandem env list`` (no task is generated)."""
    counts = {s: len(names(s)) for s in SPLITS}
    return {
        "kind": "fixed",
        "id_format": "repo:<split>:<package>-<bug>",
        "splits": counts,
        "tasks": sum(counts.values()),
        "heldout_fraction": HELDOUT_FRACTION,
        "packages": {p: len(template(p).bugs) for p in PACKAGES},
    }


def materialize(task: Task, dest: str | os.PathLike[str]) -> str:
    """Write ``task``'s base commit as a git repository at ``dest`` (must not exist); returns its sha.

    Uses the ``git`` command with a fixed identity and dates and no user or system config; raises
    RuntimeError if the sha differs from ``task.meta["base_commit"]``.
    """
    root = Path(dest)
    root.mkdir(parents=True)
    for path, content in task.workspace.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(content)
    name, email = GIT_AUTHOR
    stamp = f"{GIT_TIME} +0000"
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": tempfile.gettempdir(),
        "GIT_CONFIG_GLOBAL": os.devnull,
        "GIT_CONFIG_NOSYSTEM": "1",
        "GIT_AUTHOR_NAME": name,
        "GIT_AUTHOR_EMAIL": email,
        "GIT_AUTHOR_DATE": stamp,
        "GIT_COMMITTER_NAME": name,
        "GIT_COMMITTER_EMAIL": email,
        "GIT_COMMITTER_DATE": stamp,
    }
    message = commit_message(str(task.meta["package"]))
    for cmd in (
        ["git", "init", "-q", "-b", "main"],
        ["git", "add", "-A"],
        ["git", "-c", "commit.gpgsign=false", "commit", "-q", "--no-verify", "-m", message],
    ):
        subprocess.run(cmd, cwd=root, env=env, check=True, capture_output=True, timeout=60)
    sha = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=root, env=env, check=True, capture_output=True, text=True
    ).stdout.strip()
    if sha != task.meta["base_commit"]:
        raise RuntimeError(f"git made commit {sha} for {task.id}, expected {task.meta['base_commit']}")
    return sha

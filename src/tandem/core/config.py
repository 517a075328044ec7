"""Typed run configuration: one TOML file per run, every field documented, defaults that work on a CPU laptop.

Invariants: unknown keys are rejected; every validation error names the dotted field and the reason;
``--set a.b=value`` overrides are parsed as TOML values (falling back to strings) before validation.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from tandem.core.errors import ConfigError


class Section(BaseModel):
    """Base class of config sections: strict keys, docstrings per field (via ``description``)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_attribute_docstrings=True)


class ModelConfig(Section):
    path: str = "models/tandem-base"
    """Local directory of an HF causal LM and its tokenizer (the shipped base model by default)."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Dtype the engines serve and the trainer publishes in (trainer master weights are always float32)."""


class TaskConfig(Section):
    source: Literal["builtin", "humaneval"] = "builtin"
    """Task source: `builtin` (procedural Python function-writing tasks) or `humaneval` (the 164 HumanEval
    problems; an evaluation set, so its train and heldout splits are the same problems)."""
    levels: list[int] = [1, 2, 3]
    """Difficulty levels to draw tasks from (1 easiest; builtin only)."""
    seed: int = 0
    """Seed of the task generator; splits are disjoint by construction for every seed (builtin only)."""
    heldout_size: int = 64
    """Number of held-out tasks used by evaluation (humaneval: the first min(n, 164) problems)."""
    max_turns: int = 6
    """Assistant turns per session before it is truncated."""
    max_tokens: int = 768
    """Total tokens (prompt + sampled + observations) per session before it is truncated."""
    wall_time_s: float = 60.0
    """Wall-clock limit per session in seconds."""


class SandboxConfig(Section):
    backend: Literal["bwrap", "plain"] = "bwrap"
    """`bwrap` (bubblewrap: no network, read-only system) or `plain` (unisolated subprocess, opt-in only)."""
    timeout_s: float = 10.0
    """Wall-clock limit of one command; the whole process tree is killed at it (exit status 124)."""
    memory_mb: int = 512
    """Memory limit (cgroup v1 where available, address-space rlimit always)."""
    pids: int = 64
    """Maximum processes (cgroup v1 pids where available, RLIMIT_NPROC otherwise)."""
    cpu_s: int = 10
    """CPU-time rlimit in seconds."""
    file_mb: int = 16
    """Largest file a command may write, in MiB."""
    max_output_bytes: int = 16384
    """Stdout/stderr kept per command; the rest is cut with a visible marker."""


class RewardConfig(Section):
    kind: Literal["fraction", "all_or_nothing"] = "all_or_nothing"
    """Reward = fraction of hidden tests passed, or 1 only when all pass."""
    tool_error_penalty: float = 0.0
    """Subtracted per malformed tool call (logged as a component either way)."""
    test_edit_penalty: float = Field(default=0.0, ge=0.0)
    """Subtracted when the agent's final workspace changes a protected file (the visible tests) or adds a file
    named like a hidden test (flagged as `tests_edited` either way); never takes the reward below 0."""


class EngineConfig(Section):
    max_batch: int = 64
    """Most sessions decoded together in one step (continuous batching)."""
    max_seq_len: int = 1024
    """Longest context the engine's KV cache holds per session."""
    max_parked: int = Field(default=64, ge=0)
    """Finished sessions whose KV stays parked for prefix reuse by the next turn (0 disables); the KV cache
    gets this many extra slots beyond max_batch (memory x (max_batch+max_parked)/max_batch); LRU eviction."""
    threads: int = 1
    """Torch intra-op threads of each engine process."""
    num_engines: int = 1
    """Number of engine actors."""


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
    kl_coef: float = 0.0
    """Coefficient of the k3 KL penalty to the initial policy; 0 disables it and skips that forward pass."""
    threads: int = 1
    """Torch intra-op threads of the trainer process."""
    checkpoint_every: int = 10
    """Save a resumable checkpoint every N steps (and at the end)."""
    seed: int = 0
    """Seed of the trainer and of sampling."""


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
    relays: int = 0
    """Relays between the store server and the engines (one per region in production; local processes
    here). 0: engines fetch from the store server directly."""
    bandwidth_mbps: float = 0.0
    """Throttle of each relay's upstream link (Mbit/s) to simulate a WAN; 0 = unthrottled."""


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
    ray_address: str | None = None
    """Join this Ray cluster instead of starting a local one."""
    request_timeout_s: float = 300.0
    """A group whose rollout takes longer is abandoned and requeued; nothing waits forever."""


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
        if self.rollout.temperature <= 0:
            raise ValueError("rollout.temperature must be > 0 (greedy decoding is not a policy to train)")
        return self


def _parse_value(raw: str) -> Any:
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


def _set_dotted(d: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    for p in parts[:-1]:
        d = d.setdefault(p, {})
        if not isinstance(d, dict):
            raise ConfigError(f"--set {key}: {p} is not a section")
    d[parts[-1]] = value


def _format_error(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        loc = ".".join(str(x) for x in e["loc"]) or "(config)"
        lines.append(f"config field `{loc}`: {e['msg']} (got {e.get('input')!r})")
    return "invalid config:\n  " + "\n  ".join(lines)


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
        if not p.is_file():
            raise ConfigError(f"config file {p} does not exist; pass an existing TOML file")
        try:
            file_data = tomllib.loads(p.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {p} is not valid TOML: {e}") from e
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


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(f"cannot render {v!r} as TOML")

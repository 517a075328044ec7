"""The records that flow between subsystems (design section 3).

Invariants:
- Every record converts to a plain dict of numpy arrays and JSON values with ``to_dict`` and back with
  ``from_dict``, unchanged, so it crosses Ray and file boundaries as is.
- In a ``Segment`` all per-token arrays have the same length. ``loss_mask`` is 1 exactly for the tokens the
  policy sampled; ``sampler_logprobs`` is NaN and ``versions`` is -1 where ``loss_mask`` is 0.
- A sampled token's ``sampler_logprobs`` is its logprob under the distribution it was drawn from: the
  logits divided by ``sampler_temperature`` (1 when absent), renormalised over the top-p support whose log
  mass is ``sampler_logmass`` (0 when absent). So ``log_softmax(logits / T)[token] - logmass`` is the same
  quantity computed with any other weights.
- Token ids are those the engine consumed and produced; nothing downstream re-tokenizes text.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class Message:
    """One chat message. ``tool_calls`` holds ``{"name", "arguments"}`` dicts for assistant messages."""

    role: str
    content: str
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    name: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Message:
        return cls(d["role"], d["content"], list(d.get("tool_calls") or []), d.get("name"))


@dataclass
class TaskLimits:
    """Per-session limits; a session that reaches one ends as truncated."""

    max_turns: int = 6
    max_tokens: int = 1024
    wall_time_s: float = 60.0


@dataclass
class Task:
    """A unit of work: prompt, workspace files, hidden tests and limits.

    ``workspace`` maps relative paths to file contents the agent starts with. ``protected`` lists workspace
    paths restored from the task before scoring (visible tests). ``hidden_tests`` maps paths to files that
    are added only in the scoring sandbox and never shown to the agent.
    """

    id: str
    prompt: list[Message]
    workspace: dict[str, str]
    hidden_tests: dict[str, str]
    test_command: list[str]
    visible_test_command: list[str]
    protected: list[str] = field(default_factory=list)
    limits: TaskLimits = field(default_factory=TaskLimits)
    meta: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Task:
        return cls(
            id=d["id"],
            prompt=[Message.from_dict(m) for m in d["prompt"]],
            workspace=dict(d["workspace"]),
            hidden_tests=dict(d["hidden_tests"]),
            test_command=list(d["test_command"]),
            visible_test_command=list(d["visible_test_command"]),
            protected=list(d.get("protected", [])),
            limits=TaskLimits(**d.get("limits", {})),
            meta=dict(d.get("meta", {})),
        )


@dataclass
class Segment:
    """One context window of a session, token-exact (see module invariants)."""

    token_ids: np.ndarray  # int32 [T]
    loss_mask: np.ndarray  # uint8 [T]
    sampler_logprobs: np.ndarray  # float32 [T], NaN where not sampled
    versions: np.ndarray  # int32 [T], -1 where not sampled
    routed_experts: np.ndarray | None = None  # int16/uint8 [T, moe_layers, top_k]
    sampler_logmass: np.ndarray | None = None  # float32 [T], 0 where not truncated; None: all 0
    sampler_temperature: np.ndarray | None = None  # float32 [T], 1 where not sampled; None: all 1

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        for name in ("loss_mask", "sampler_logprobs", "versions", "sampler_logmass", "sampler_temperature"):
            if getattr(self, name) is not None and len(getattr(self, name)) != n:
                raise ValueError(f"Segment.{name} has length {len(getattr(self, name))}, token_ids has {n}")

    @classmethod
    def empty(cls) -> Segment:
        return cls(
            np.zeros(0, np.int32), np.zeros(0, np.uint8), np.zeros(0, np.float32), np.zeros(0, np.int32)
        )

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_sampled(self) -> int:
        return int(self.loss_mask.sum())

    def oldest_version(self) -> int | None:
        sampled = self.versions[self.loss_mask.astype(bool)]
        return int(sampled.min()) if len(sampled) else None

    def to_dict(self) -> dict[str, Any]:
        d = {
            "token_ids": self.token_ids,
            "loss_mask": self.loss_mask,
            "sampler_logprobs": self.sampler_logprobs,
            "versions": self.versions,
        }
        for name in ("routed_experts", "sampler_logmass", "sampler_temperature"):
            if getattr(self, name) is not None:
                d[name] = getattr(self, name)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Segment:
        return cls(
            np.asarray(d["token_ids"], np.int32),
            np.asarray(d["loss_mask"], np.uint8),
            np.asarray(d["sampler_logprobs"], np.float32),
            np.asarray(d["versions"], np.int32),
            None if d.get("routed_experts") is None else np.asarray(d["routed_experts"]),
            None if d.get("sampler_logmass") is None else np.asarray(d["sampler_logmass"], np.float32),
            None
            if d.get("sampler_temperature") is None
            else np.asarray(d["sampler_temperature"], np.float32),
        )


class SegmentBuilder:
    """Appends prompt tokens (not sampled) and sampled tokens to a growing segment, keeping invariants."""

    def __init__(self) -> None:
        self.ids: list[int] = []
        self.mask: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        self.logmass: list[float] = []
        self.temperature: list[float] = []

    def add_context(self, ids: list[int]) -> None:
        self.ids.extend(ids)
        self.mask.extend([0] * len(ids))
        self.logprobs.extend([math.nan] * len(ids))
        self.versions.extend([-1] * len(ids))
        self.logmass.extend([0.0] * len(ids))
        self.temperature.extend([1.0] * len(ids))

    def add_sampled(
        self,
        ids: list[int],
        logprobs: list[float],
        versions: list[int],
        logmass: list[float] | None = None,
        temperature: float = 1.0,
    ) -> None:
        """Append sampled tokens with the sampler's logprobs, versions, top-p log masses (None: no
        truncation) and the temperature they were sampled at (0, greedy, is recorded as 1)."""
        if not (len(ids) == len(logprobs) == len(versions)) or (
            logmass is not None and len(logmass) != len(ids)
        ):
            raise ValueError("sampled ids, logprobs, versions and logmass must have equal lengths")
        self.ids.extend(ids)
        self.mask.extend([1] * len(ids))
        self.logprobs.extend(logprobs)
        self.versions.extend(versions)
        self.logmass.extend(logmass if logmass is not None else [0.0] * len(ids))
        self.temperature.extend([float(temperature) if temperature > 0 else 1.0] * len(ids))

    def __len__(self) -> int:
        return len(self.ids)

    def build(self) -> Segment:
        logmass = np.asarray(self.logmass, np.float32)
        temperature = np.asarray(self.temperature, np.float32)
        return Segment(
            np.asarray(self.ids, np.int32),
            np.asarray(self.mask, np.uint8),
            np.asarray(self.logprobs, np.float32),
            np.asarray(self.versions, np.int32),
            sampler_logmass=logmass if logmass.any() else None,
            sampler_temperature=temperature if (temperature != 1.0).any() else None,
        )


@dataclass
class Reward:
    """A scalar reward and the named components it was made from."""

    value: float
    components: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"value": self.value, "components": dict(self.components)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Reward:
        return cls(float(d["value"]), dict(d.get("components", {})))


@dataclass
class Trajectory:
    """All segments of one session, its reward, flags, timings and tool-call statistics.

    ``diff`` is the agent's full change to the task's workspace: a unified diff of its final files against
    ``task.workspace`` ("" when unchanged, and in records written before the field existed).
    """

    task_id: str
    segments: list[Segment]
    reward: Reward
    flags: dict[str, bool] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    tool_stats: dict[str, int] = field(default_factory=dict)
    messages: list[Message] = field(default_factory=list)
    diff: str = ""

    def oldest_version(self) -> int | None:
        vs = [v for s in self.segments if (v := s.oldest_version()) is not None]
        return min(vs) if vs else None

    @property
    def num_sampled(self) -> int:
        return sum(s.num_sampled for s in self.segments)

    def to_dict(self) -> dict[str, Any]:
        return {
            "task_id": self.task_id,
            "segments": [s.to_dict() for s in self.segments],
            "reward": self.reward.to_dict(),
            "flags": dict(self.flags),
            "timings": dict(self.timings),
            "tool_stats": dict(self.tool_stats),
            "messages": [m.to_dict() for m in self.messages],
            "diff": self.diff,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Trajectory:
        return cls(
            d["task_id"],
            [Segment.from_dict(s) for s in d["segments"]],
            Reward.from_dict(d["reward"]),
            dict(d.get("flags", {})),
            dict(d.get("timings", {})),
            dict(d.get("tool_stats", {})),
            [Message.from_dict(m) for m in d.get("messages", [])],
            str(d.get("diff") or ""),
        )


@dataclass
class Group:
    """The G trajectories sampled for one task; the unit the buffer hands to the trainer."""

    task_id: str
    trajectories: list[Trajectory]

    def oldest_version(self) -> int | None:
        vs = [v for t in self.trajectories if (v := t.oldest_version()) is not None]
        return min(vs) if vs else None

    def rewards(self) -> np.ndarray:
        return np.asarray([t.reward.value for t in self.trajectories], np.float32)

    def to_dict(self) -> dict[str, Any]:
        return {"task_id": self.task_id, "trajectories": [t.to_dict() for t in self.trajectories]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Group:
        return cls(d["task_id"], [Trajectory.from_dict(t) for t in d["trajectories"]])


@dataclass(frozen=True)
class Version:
    """A policy version: a monotone integer plus the content hash of its weights."""

    number: int
    weights_hash: str = ""

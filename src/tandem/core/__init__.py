"""Layer 0: records, configuration, errors and the generation protocol every subsystem shares."""

from tandem.core.config import RunConfig, dump_config, load_config
from tandem.core.errors import ConfigError, EngineError, ModelLoadError, SandboxError, TandemError
from tandem.core.generation import ChatFormat, Completion, GenerationRequest, SamplingParams
from tandem.core.records import (
    Group,
    Message,
    Reward,
    Segment,
    SegmentBuilder,
    Task,
    TaskLimits,
    Trajectory,
    Version,
)

__all__ = [
    "ChatFormat",
    "Completion",
    "ConfigError",
    "EngineError",
    "GenerationRequest",
    "Group",
    "Message",
    "ModelLoadError",
    "Reward",
    "RunConfig",
    "SamplingParams",
    "SandboxError",
    "Segment",
    "SegmentBuilder",
    "TandemError",
    "Task",
    "TaskLimits",
    "Trajectory",
    "Version",
    "dump_config",
    "load_config",
]

"""Error types. Every message says what was wrong, with the value, and what to do."""


class TandemError(Exception):
    """Base class for errors tandem raises on purpose."""


class ConfigError(TandemError):
    """A configuration value is invalid; the message names the field."""


class ModelLoadError(TandemError):
    """A model or tokenizer path is missing or unreadable."""


class SandboxError(TandemError):
    """A sandbox could not be created or used."""


class EngineError(TandemError):
    """An inference engine rejected a request or failed."""

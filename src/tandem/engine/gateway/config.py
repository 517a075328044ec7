"""Typed configuration of the OpenAI-compatible gateway (``tandem serve``).

Invariants:
- Unknown keys are rejected and every field has a docstring and a default that works on a CPU laptop (the
  same rules as the sections of ``tandem.core.config``; this class is meant to move there as ``gateway``).
- A gateway bound to anything other than a loopback address must have an API key: the config refuses to
  validate otherwise, so a server that would be open to the network never starts.
"""

from __future__ import annotations

import ipaddress

from pydantic import BaseModel, ConfigDict, Field, model_validator


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback IP addresses (127.0.0.0/8, ::1); False for anything else."""
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to a public address


class GatewayConfig(BaseModel):
    """Settings of one gateway process (see module invariants)."""

    model_config = ConfigDict(
        extra="forbid", validate_assignment=True, use_attribute_docstrings=True, allow_inf_nan=False
    )

    host: str = "127.0.0.1"
    """Address to listen on. Anything but a loopback address requires `api_key`."""
    port: int = Field(default=8000, ge=0, le=65535)
    """TCP port to listen on (0 picks a free one)."""
    api_key: str | None = None
    """When set, every /v1 request must carry `Authorization: Bearer <api_key>` (401 otherwise). /health
    stays open. Printable ASCII without spaces. Required when `host` is not a loopback address."""
    model_name: str | None = None
    """Model id reported by /v1/models and in responses (default: the model directory's name). Requests may
    name any model: the gateway serves exactly one."""
    max_concurrent: int = Field(default=64, ge=1)
    """Chat completion requests in flight at once; more get 429 with Retry-After (the server stays up)."""
    retry_after_s: int = Field(default=1, ge=0)
    """Seconds sent in the Retry-After header of a 429."""
    max_sessions: int = Field(default=1024, ge=1)
    """Session records kept in memory; beyond it the least recently used idle session is evicted (counted).
    A session with a request in flight (generating, or waiting behind an earlier request of the same
    session) is never evicted: when every other session is busy the cap is exceeded temporarily (by at most
    one session per request in flight, so by at most `max_concurrent`) rather than refusing the new session,
    and the extra idle sessions are evicted when the next request opens a session."""
    max_n: int = Field(default=8, ge=1)
    """Largest `n` (choices per request) accepted."""
    default_max_tokens: int = Field(default=256, ge=1)
    """Tokens sampled per choice when a request names no `max_tokens` (clamped to the context left)."""
    max_body_bytes: int = Field(default=8 * 1024 * 1024, ge=1024)
    """Largest request body accepted, in bytes (413 beyond it)."""
    body_timeout_s: float = Field(default=30.0, gt=0)
    """Seconds a client has to send its whole request body (408 after it), so a client that never finishes
    one does not hold an in-flight slot for good."""
    request_timeout_s: float = Field(default=600.0, gt=0)
    """A generation that takes longer than this gets 504 (the engine keeps serving other requests)."""

    @model_validator(mode="after")
    def _open_bind_needs_key(self) -> GatewayConfig:
        if not is_loopback(self.host) and not self.api_key:
            raise ValueError(
                f"host={self.host!r} is not a loopback address and no api_key is set: refusing to serve the "
                "model to the network without authentication; pass --api-key KEY (clients then send "
                "'Authorization: Bearer KEY') or bind to 127.0.0.1"
            )
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("api_key is empty; pass a non-empty key or leave it unset")
        if self.api_key is not None and not all("!" <= c <= "~" for c in self.api_key):
            raise ValueError(
                "api_key must be printable ASCII without spaces (clients send it in an HTTP header, where "
                "other characters do not arrive as typed, so the key could never match); pick another key"
            )
        return self

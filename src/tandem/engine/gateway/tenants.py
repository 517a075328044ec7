"""Per-client keys of one gateway: what each external-harness rollout may do through the gateway it shares.

A rollout worker serves one gateway for all its rollouts. Each rollout's harness gets a key of its own
(``Tenants.add``), never the gateway's own ``api_key``, so no rollout can starve, evict or read the others.

Invariants:
- A request with a tenant's key counts against that tenant's ``max_in_flight`` (429 past it, before its body
  is read) besides the gateway's ``max_concurrent``, and against its ``max_requests`` in all (429 once they
  are used: a rollout's turns, so its record holds at most that many segments; a probe's harness had made
  3264 requests with edited histories in 45 s, 3.1M tokens in 3263 segments, about 45 minutes of one trainer
  step); the sessions it names count against its ``max_sessions`` (429 for one more); a session id belongs
  to the first tenant that names it, and another tenant's request, read or reward with that id is a 404, as
  for a session that does not exist.
- ``revoke(key)`` (thread-safe; called when the rollout's harness has exited): the key gets 401 from then on,
  and every generation the tenant still has in flight is cancelled on the gateway's event loop, so its
  in-flight slots free at once and engines drop what they have not started (``RequestFront`` skips cancelled
  requests). A probe's harness left 200 requests of ``n=8`` behind it: the gateway answered 429 to the next
  rollouts and the engine had 1592 sequences queued.
- A tenant with a ``sampling`` (a training rollout's key, ``rollout.harness_sampling = "run"``) is served
  at the run's temperature and top-p whatever its requests ask, with ``max_tokens`` at most the run's, no
  ``seed`` and no ``ignore_eos``: the policy gradient and its importance ratios assume samples from the
  policy at the run's settings, and a production harness that asks for ``temperature=0`` or a fixed seed
  would otherwise make every session of a group the same (no advantage, nothing learned). Requests whose
  settings it changed are counted (``sampling_overridden``).
- The tenant's counters and future sets are touched only on the gateway's event loop; the key table is
  guarded by a lock. Keys are looked up by their SHA-256, never compared byte by byte.
"""

from __future__ import annotations

import asyncio
import hashlib
import threading
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Sampling:
    """How a tenant's requests are sampled, whatever they ask (see module invariants)."""

    temperature: float
    top_p: float
    max_tokens: int

    def apply(self, req: Any) -> bool:
        """Set ``req``'s (a ``ChatRequest``) sampling fields to these; True when any of them changed."""
        max_tokens = self.max_tokens if req.max_tokens is None else min(req.max_tokens, self.max_tokens)
        changed = (
            req.temperature != self.temperature
            or req.top_p != self.top_p
            or req.seed is not None
            or req.ignore_eos
            or (req.max_tokens is not None and req.max_tokens > self.max_tokens)
        )
        req.temperature, req.top_p, req.max_tokens = self.temperature, self.top_p, max_tokens
        req.seed, req.ignore_eos = None, False
        return changed


@dataclass(eq=False)
class Tenant:
    """One key's limits and what it holds now."""

    name: str
    max_in_flight: int
    max_sessions: int
    max_requests: int | None = None  # chat requests in all (None: no limit)
    sampling: Sampling | None = None  # served at these settings (None: as each request asks)
    sampling_overridden: int = 0  # requests whose sampling settings ``sampling`` changed
    requests: int = 0
    in_flight: int = 0
    sessions: set[str] = field(default_factory=set)
    futures: set[asyncio.Future] = field(default_factory=set)
    revoked: bool = False
    loop: asyncio.AbstractEventLoop | None = None  # the gateway's loop, where its futures live


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class Tenants:
    """The gateway's tenant keys (see module invariants)."""

    def __init__(self) -> None:
        self._by_digest: dict[bytes, Tenant] = {}
        self._owner: dict[str, Tenant] = {}  # session id -> the tenant that named it first
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._by_digest)

    def add(
        self,
        key: str,
        name: str,
        max_in_flight: int,
        max_sessions: int,
        max_requests: int | None = None,
        sampling: Sampling | None = None,
    ) -> Tenant:
        """Register ``key`` (a random token, at least 16 characters) for a client named ``name``."""
        if len(key) < 16:
            raise ValueError("a tenant key must be a random token of at least 16 characters")
        if max_in_flight < 1 or max_sessions < 1 or (max_requests is not None and max_requests < 1):
            raise ValueError(
                f"max_in_flight={max_in_flight}, max_sessions={max_sessions} and max_requests={max_requests} "
                "must be >= 1"
            )
        tenant = Tenant(name, max_in_flight, max_sessions, max_requests, sampling)
        with self._lock:
            if _digest(key) in self._by_digest:
                raise ValueError(f"tenant key of {name!r} is already registered")
            self._by_digest[_digest(key)] = tenant
        return tenant

    def find(self, key: str) -> Tenant | None:
        with self._lock:
            return self._by_digest.get(_digest(key))

    def claim(self, tenant: Tenant, sid: str) -> str | None:
        """Let ``tenant`` use session ``sid``; None when it may, else why not ("other" or "limit")."""
        with self._lock:
            owner = self._owner.get(sid)
            if owner is tenant:
                return None
            if owner is not None:
                return "other"
            if len(tenant.sessions) >= tenant.max_sessions:
                return "limit"
            self._owner[sid] = tenant
            tenant.sessions.add(sid)
            return None

    def may_read(self, tenant: Tenant | None, sid: str) -> bool:
        """Whether a request of ``tenant`` (None: the gateway's own key) may read or reward ``sid``."""
        if tenant is None:
            return True
        with self._lock:
            return self._owner.get(sid) is tenant

    def revoke(self, key: str) -> None:
        """Remove ``key``; cancel its tenant's generations in flight (see module invariants)."""
        with self._lock:
            tenant = self._by_digest.pop(_digest(key), None)
            if tenant is None:
                return
            tenant.revoked = True
            for sid in tenant.sessions:
                if self._owner.get(sid) is tenant:
                    del self._owner[sid]
        loop = tenant.loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(_cancel_all, tenant)


def _cancel_all(tenant: Tenant) -> None:
    for fut in list(tenant.futures):
        fut.cancel()

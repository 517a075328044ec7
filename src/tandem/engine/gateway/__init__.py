"""The OpenAI-compatible rollout gateway: any harness that speaks the OpenAI chat API can be trained.

``create_app(engine, chat_format, tokenizer, config)`` builds the FastAPI app; ``GatewayServer`` runs it in a
thread (tests, benchmarks), ``run_forever`` in the foreground (``tandem serve``). Modules: ``config``
(``GatewayConfig``), ``protocol`` (request validation), ``sessions`` (token-exact session records),
``responses`` (OpenAI JSON and SSE), ``app`` (routes, auth, limits), ``server`` (uvicorn).

Invariant (the reason this exists): the token ids a session records are the ones the engine consumed and
produced; history sent back as text is matched against the record and never re-tokenized.
"""

from tandem.core.lazy import lazy_exports

_WHERE = {
    "create_app": "tandem.engine.gateway.app",
    "GatewayConfig": "tandem.engine.gateway.config",
    "is_loopback": "tandem.engine.gateway.config",
    "GatewayServer": "tandem.engine.gateway.server",
    "bind_socket": "tandem.engine.gateway.server",
    "run_forever": "tandem.engine.gateway.server",
    "Session": "tandem.engine.gateway.sessions",
    "SessionStore": "tandem.engine.gateway.sessions",
}
__getattr__ = lazy_exports(__name__, _WHERE)  # `tandem serve --help` needs only the config

__all__ = [
    "GatewayConfig",
    "GatewayServer",
    "Session",
    "SessionStore",
    "bind_socket",
    "create_app",
    "is_loopback",
    "run_forever",
]

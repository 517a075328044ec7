"""The OpenAI-compatible rollout gateway: any harness that speaks the OpenAI chat API can be trained.

``create_app(engine, chat_format, tokenizer, config)`` builds the FastAPI app; ``GatewayServer`` runs it in a
thread (tests, benchmarks), ``run_forever`` in the foreground (``tandem serve``). Modules: ``config``
(``GatewayConfig``), ``protocol`` (request validation), ``sessions`` (token-exact session records),
``responses`` (OpenAI JSON and SSE), ``app`` (routes, auth, limits), ``server`` (uvicorn).

Invariant (the reason this exists): the token ids a session records are the ones the engine consumed and
produced; history sent back as text is matched against the record and never re-tokenized.
"""

from tandem.engine.gateway.app import create_app
from tandem.engine.gateway.config import GatewayConfig, is_loopback
from tandem.engine.gateway.server import GatewayServer, bind_socket, run_forever
from tandem.engine.gateway.sessions import Session, SessionStore

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

"""The gateway's FastAPI app: OpenAI ``/v1/chat/completions`` in front of one engine, with session records.

Routes: ``POST /v1/chat/completions``, ``GET /v1/models``, ``GET /health``,
``GET /v1/tandem/sessions/{id}`` (the trajectory record as JSON), ``POST /v1/tandem/sessions/{id}/reward``.

Invariants:
- Every error is OpenAI's JSON shape ``{"error": {"message", "type", "param", "code"}}`` with a message that
  names the field; bad input is a 4xx answer and a counter in ``/health``, never a crash. Engine failures
  are 500/503/504 answers, counted the same way. An unexpected exception (a bug) is logged and answered 500
  by ``_CatchAll`` without dropping the connection (Starlette's own handler re-raises, and the server then
  closes the keep-alive connection).
- Request bodies are read up to ``max_body_bytes`` and no further (413 as soon as a chunked body passes it),
  within ``body_timeout_s`` (408 after it: a probe's four clients that never finished their bodies held
  every slot, and everyone else got 429)
  and decoded strictly (``protocol.decode_json``: no lone surrogates, no non-finite numbers, anywhere)
  before any route looks at them, so nothing generated, stored or served later can fail on them. A chat
  request that needs at least the context's tokens (``prefilter.PromptFloor``: its rendered text over the
  longest token's characters, plus the template's fewest tokens per message, tool call and tool) is
  refused (400, ``messages``) before anything is tokenized.
- With ``config.api_key`` set, every ``/v1`` route needs ``Authorization: Bearer <key>`` (401 otherwise,
  constant-time comparison); ``/health`` stays open. Tenant keys (``state.gateway.tenants``, see
  ``tandem.engine.gateway.tenants``) are accepted too, each with its own limits and sessions; once a key
  is registered, a request without a valid key is refused even when ``api_key`` is unset.
- At most ``config.max_concurrent`` chat requests are in flight; one more gets 429 with ``Retry-After``
  before its body is read. Counting happens on the event loop thread only (no locks needed).
- A request with a session id (``X-Tandem-Session`` header, read as UTF-8, else the ``user`` field; checked by
  ``protocol.session_id``) is recorded as described in ``tandem.engine.gateway.sessions``; the prompt sent to
  the engine is the session's recorded ids plus the new context. Without a session id nothing is recorded.
- A client that has disconnected when its request's turn comes (the session lock acquired) is not generated
  for; a non-streamed request whose client disconnects while it generates has its generations cancelled
  (engines drop queued ones and the built-in engine stops running ones) and is not recorded (both answered
  499 to nobody and counted as ``disconnected``): a harness that timed out and retried left the abandoned
  generations running before.
- ``stream: true``: the answer is produced by its own task (it holds the session lock and its in-flight
  slots, the gateway's and its tenant's, until generation ends and the record is committed, however slowly
  the client reads; a stream whose client hangs up before its last chunk has its generations cancelled and
  is not recorded, counted as ``disconnected``: a probe's abandoned ``max_tokens=1000`` streams had kept
  the engine busy to their end, and its tenant's streams had not counted against the key's limit); content
  chunks go out as the engine samples tokens when the engine has ``streams_tokens`` (``submit(...,
  on_tokens=...)``, fed to this event loop with ``call_soon_threadsafe``), else all at the end. Bad input is
  still a 4xx answer (checked before the stream starts); a failure after it started is an ``error`` event.
- The app never starts or stops the engine: whoever built the engine owns it (several apps may share one).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tandem.core.generation import ChatFormat, Completion, GenerationRequest, SamplingParams
from tandem.engine.gateway.config import GatewayConfig
from tandem.engine.gateway.forcing import ForcingUnsupported, forced_prefix
from tandem.engine.gateway.prefilter import PromptFloor, prompt_chars, prompt_parts
from tandem.engine.gateway.protocol import (
    BadRequest,
    ChatRequest,
    decode_json,
    parse_chat_request,
    parse_reward,
    session_id,
)
from tandem.engine.gateway.responses import ResponseBuilder, to_turn
from tandem.engine.gateway.sessions import Plan, Session, SessionStore, Turn
from tandem.engine.gateway.stream import ContentStream
from tandem.engine.gateway.tenants import Tenant, Tenants

log = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    499: "client_disconnected",
    500: "server_error",
    503: "server_error",
    504: "timeout_error",
}


class Engine(Protocol):
    """What the gateway needs of an engine (``BuiltinEngine`` and ``VllmEngine`` have it). Optional
    attributes: ``max_top_logprobs`` (0: top_logprobs refused), ``supports_top_p`` (False: top_p < 1 gets
    400), ``streams_tokens`` (True: ``submit(request, on_tokens=f)`` calls ``f`` with the sampled ids as
    they come, so streams are live)."""

    @property
    def version(self) -> int: ...

    def submit(self, request: GenerationRequest) -> Any: ...  # concurrent Future[Completion]

    def health(self) -> dict[str, Any]: ...


def context_length(engine: Any) -> int:
    """Tokens per sequence the engine holds (prompt + sampled): ``max_seq_len`` or ``config.max_seq_len``."""
    n = getattr(engine, "max_seq_len", None)
    return int(n if n is not None else engine.config.max_seq_len)


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers


def _error(status: int, message: str, param: str | None = None, headers: dict | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": _TYPES.get(status, "error"), "param": param, "code": None}}
    return JSONResponse(body, status_code=status, headers=headers)


class _CatchAll:
    """ASGI middleware (inside Starlette's error middleware, outside its handlers): an exception that escapes
    a route before its response started is logged and answered 500 by ``on_error``, and the request ends
    normally, so the server keeps the connection alive. After the response started nothing can be answered:
    the exception propagates and the server closes the connection."""

    def __init__(self, app: ASGIApp, on_error: Callable[[Exception], JSONResponse]) -> None:
        self.app, self.on_error = app, on_error

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def watch(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watch)
        except Exception as e:
            if started:
                raise
            log.exception("unexpected error in %s %s", scope.get("method"), scope.get("path"))
            await self.on_error(e)(scope, receive, send)


class _State:
    def __init__(self, config: GatewayConfig) -> None:
        self.sessions = SessionStore(config.max_sessions)
        self.tenants = Tenants()
        self.in_flight = 0
        self.tasks: set[asyncio.Task] = set()  # streams being produced (a reference keeps them alive)
        self.counters = {
            "requests": 0,
            "completed": 0,
            "rejected_429": 0,
            "bad_request": 0,
            "unauthorized": 0,
            "engine_error": 0,
            "timeout": 0,
            "disconnected": 0,
            "tokens_generated": 0,
        }


def create_app(
    engine: Engine, chat_format: ChatFormat, tokenizer: Any, config: GatewayConfig | None = None
) -> FastAPI:
    """The gateway app over ``engine`` (see module invariants). ``tokenizer`` decodes text for responses."""
    cfg = config or GatewayConfig()
    model_name = cfg.model_name or "tandem"
    ctx = context_length(engine)
    floor = PromptFloor(chat_format, tokenizer)
    end_of_turn = int(chat_format.stop_token_ids[0])
    top_lp = int(getattr(engine, "max_top_logprobs", 0))
    top_p_ok = bool(getattr(engine, "supports_top_p", True))
    live = bool(getattr(engine, "streams_tokens", False))
    st = _State(cfg)
    t_start = int(time.time())
    app = FastAPI(title="tandem gateway", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.gateway = st

    def decode(ids: list[int]) -> str:
        return tokenizer.decode(list(ids), skip_special_tokens=False)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError) -> JSONResponse:
        key = {
            400: "bad_request",
            413: "bad_request",
            401: "unauthorized",
            408: "timeout",
            429: "rejected_429",
            499: "disconnected",
        }.get(e.status)
        if key:
            st.counters[key] += 1
        return _error(e.status, e.message, e.param, e.headers)

    @app.exception_handler(BadRequest)
    async def _bad_request(request: Request, e: BadRequest) -> JSONResponse:
        return await _api_error(request, ApiError(e.status, e.message, e.param))

    @app.exception_handler(ClientDisconnect)
    async def _gone_early(request: Request, e: ClientDisconnect) -> JSONResponse:  # while reading the body
        return await _api_error(request, _gone("before its request body was read"))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        return _error(e.status_code, f"{e.detail} ({request.method} {request.url.path})", None, e.headers)

    def _unexpected(e: Exception) -> JSONResponse:  # a bug: answer, keep serving (``_CatchAll``)
        st.counters["engine_error"] += 1
        return _error(500, f"internal error: {type(e).__name__}: {e}")

    app.add_middleware(_CatchAll, on_error=_unexpected)

    def _gone(when: str) -> ApiError:
        return ApiError(499, f"the client disconnected {when}; nothing was recorded")

    def check_auth(request: Request) -> Tenant | None:
        """None for the gateway's own key (or an open gateway), the tenant of a tenant key; else 401."""
        if cfg.api_key is None and not len(st.tenants):
            return None
        got = request.headers.get("authorization", "")
        scheme, _, token = got.partition(" ")
        token = token.strip()
        if scheme.lower() == "bearer":
            if cfg.api_key is not None and hmac.compare_digest(token.encode(), cfg.api_key.encode()):
                return None
            tenant = st.tenants.find(token)
            if tenant is not None:
                return tenant
        raise ApiError(
            401,
            "missing or wrong API key: send the header 'Authorization: Bearer <key>' with the key the "
            "gateway was started with (--api-key), or the key your rollout was given (OPENAI_API_KEY), which "
            "ends with the rollout",
            None,
            {"WWW-Authenticate": "Bearer"},
        )

    @app.get("/health")
    async def health() -> JSONResponse:
        eng = engine.health()
        body = {
            "status": "ok" if eng.get("ok", True) else "unavailable",
            "version": engine.version,
            "engine": eng,
            "in_flight": st.in_flight,
            "sessions": len(st.sessions),
            "sessions_evicted": st.sessions.evicted,
            "counters": dict(st.counters),
        }
        return JSONResponse(body, status_code=200 if body["status"] == "ok" else 503)

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        check_auth(request)
        card = {"id": model_name, "object": "model", "created": t_start, "owned_by": "tandem"}
        return JSONResponse({"object": "list", "data": [{**card, "max_model_len": ctx}]})

    @app.get("/v1/tandem/sessions/{sid}")
    async def get_session(sid: str, request: Request) -> JSONResponse:
        return JSONResponse(_session(sid, check_auth(request)).to_json())

    @app.post("/v1/tandem/sessions/{sid}/reward")
    async def post_reward(sid: str, request: Request) -> JSONResponse:
        session = _session(sid, check_auth(request))
        session.reward = parse_reward(await _json_body(request))
        return JSONResponse({"session_id": sid, "reward": session.reward.to_dict()})

    def _session(sid: str, tenant: Tenant | None) -> Session:
        s = st.sessions.get(sid) if st.tenants.may_read(tenant, sid) else None  # another tenant's: "no such"
        if s is None:
            raise ApiError(
                404,
                f"no session {sid!r}: it never made a request with this id, or it was evicted (the gateway "
                f"keeps the {cfg.max_sessions} most recently used sessions)",
                "session_id",
            )
        return s

    async def _json_body(request: Request) -> Any:
        """The body, read up to ``max_body_bytes`` and no further (413) within ``body_timeout_s`` (408),
        decoded by ``decode_json``."""
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > cfg.max_body_bytes:
            raise ApiError(413, f"request body of {length} bytes exceeds max_body_bytes={cfg.max_body_bytes}")
        raw = bytearray()
        try:
            async with asyncio.timeout(cfg.body_timeout_s):  # a body that never ends held its slot for good
                async for chunk in request.stream():
                    raw += chunk
                    if len(raw) > cfg.max_body_bytes:  # a chunked body: stop reading here
                        raise ApiError(413, f"request body exceeds max_body_bytes={cfg.max_body_bytes}")
        except TimeoutError:
            raise ApiError(
                408,
                f"the request body did not arrive within body_timeout_s={cfg.body_timeout_s} s "
                f"({len(raw)} bytes came); send the whole body at once",
            ) from None
        return decode_json(bytes(raw))

    def _header_session(request: Request) -> str | None:
        """``X-Tandem-Session`` as the UTF-8 text the client sent (Starlette decodes headers as latin-1)."""
        raw = request.headers.get("x-tandem-session")
        try:
            sid = raw.encode("latin-1").decode("utf-8") if raw else None
        except UnicodeDecodeError:
            raise ApiError(400, "X-Tandem-Session must be UTF-8 text", "X-Tandem-Session") from None
        return session_id(sid, "X-Tandem-Session")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        tenant = check_auth(request)
        st.counters["requests"] += 1
        if st.in_flight >= cfg.max_concurrent:
            raise ApiError(
                429,
                f"too many requests in flight (max_concurrent={cfg.max_concurrent}); retry after "
                f"{cfg.retry_after_s} s",
                None,
                {"Retry-After": str(cfg.retry_after_s)},
            )
        if tenant is not None and tenant.max_requests is not None and tenant.requests >= tenant.max_requests:
            raise ApiError(
                429,
                f"this key has made its {tenant.max_requests} requests (its rollout's turns, "
                "tasks.max_turns); no more are served",
            )
        if tenant is not None and tenant.in_flight >= tenant.max_in_flight:
            raise ApiError(
                429,
                f"too many requests in flight for this key (at most {tenant.max_in_flight} at once); retry "
                f"after {cfg.retry_after_s} s",
                None,
                {"Retry-After": str(cfg.retry_after_s)},
            )
        st.in_flight += 1
        if tenant is not None:
            tenant.in_flight += 1
            tenant.requests += 1
            tenant.loop = asyncio.get_running_loop()
        try:
            return await _chat(request, tenant)
        finally:
            st.in_flight -= 1
            if tenant is not None:
                tenant.in_flight -= 1

    def _revoked() -> ApiError:
        return ApiError(401, "this key was revoked (its rollout ended); nothing was generated or recorded")

    def _claim(tenant: Tenant | None, sid: str | None) -> None:
        why = None if tenant is None or sid is None else st.tenants.claim(tenant, sid)
        if why == "other":
            raise ApiError(404, f"no session {sid!r} for this key: another client's session", "session_id")
        if why == "limit":
            raise ApiError(
                429, f"this key may name at most {tenant.max_sessions} sessions; reuse one", "session_id"
            )

    async def _chat(request: Request, tenant: Tenant | None) -> Any:
        body = await _json_body(request)
        need = floor.tokens(body)
        if need >= ctx:  # before tokenizing: 8 MiB took the loop 6.5 s, 200 000 empty messages 2.9 s
            raise ApiError(
                400,
                f"the messages and tools need at least {need} tokens ({prompt_chars(body)} characters and "
                f"{sum(prompt_parts(body))} messages, tool calls and tools), more than the model's context "
                f"of {ctx} tokens can take; shorten the messages or start a new session",
                "messages",
            )
        req = parse_chat_request(body, max_n=cfg.max_n, max_tokens_limit=ctx, max_top_logprobs=top_lp)
        if tenant is not None and tenant.sampling is not None and tenant.sampling.apply(req):
            tenant.sampling_overridden += 1
        if req.top_p < 1.0 and not top_p_ok:
            raise ApiError(
                400,
                f"top_p={req.top_p}: this gateway's engine samples the full distribution only (it cannot "
                "report the mass top-p keeps, which training needs); send top_p=1 or omit it",
                "top_p",
            )
        try:
            forced = forced_prefix(chat_format, req.tool_choice)
        except ForcingUnsupported as e:
            raise ApiError(400, str(e), "tool_choice") from None
        sid = _header_session(request) or session_id(req.user, "user")
        _claim(tenant, sid)
        session = None if sid is None else await st.sessions.acquire(sid)
        plan: Plan | None = None
        owned = True  # this coroutine releases the session (a stream's producer takes it over)
        try:
            if await request.is_disconnected():  # e.g. it gave up while waiting for the session
                raise _gone("before generation started")
            if session is None:
                base = chat_format.render_prompt(req.messages, req.tools)
            else:
                plan = session.plan(req.messages, req.tools, chat_format, end_of_turn)
                base = plan.prompt_ids
            prompt = base + forced
            if req.stream:
                builder = ResponseBuilder(req, model_name, prompt, engine.version, decode)
                out: asyncio.Queue[str | None] = asyncio.Queue()
                tokens: asyncio.Queue[tuple[int, list[int] | None]] = asyncio.Queue()
                futures = _submit(prompt, req, tokens, tenant)
                st.in_flight += 1  # both released by the producer when the stream is complete
                if tenant is not None:
                    tenant.in_flight += 1
                job = _produce(req, forced, futures, tokens, builder, session, plan, out, tenant)
                task = asyncio.create_task(job)
                st.tasks.add(task)
                task.add_done_callback(st.tasks.discard)
                owned = False
                return StreamingResponse(_drain(out, task), media_type="text/event-stream")
            t0 = time.perf_counter()
            futures = _submit(prompt, req, None, tenant)
            turns, finishes = await _collect(futures, req, forced, tenant, request)
            if await request.is_disconnected():  # nobody would see this turn: do not record it
                raise _gone("before its answer was ready")
            extra = _commit(session, plan, req, turns, time.perf_counter() - t0)
            builder = ResponseBuilder(req, model_name, prompt, engine.version, decode)
        finally:
            if session is not None and owned:
                st.sessions.release(session)  # forgets it when its first request failed
        return JSONResponse(builder.completion(turns, finishes, extra))  # no FastAPI encoder pass

    def _commit(
        session: Session | None, plan: Plan | None, req: ChatRequest, turns: list[Turn], seconds: float
    ) -> dict[str, Any] | None:
        """Count a successful generation and record it in its session; the session info for the answer."""
        st.counters["completed"] += 1
        st.counters["tokens_generated"] += sum(len(t.token_ids) for t in turns)
        if session is None or plan is None:
            return None
        session.commit(plan, req.messages, turns, seconds)
        return _session_info(session, plan)

    def _session_info(session: Session, plan: Plan) -> dict[str, Any]:
        return {
            "session": session.id,
            "segment": len(session.segments),
            "new_segment": plan.new_segment,
            "new_segment_reason": plan.reason,
        }

    def _submit(
        prompt: list[int],
        req: ChatRequest,
        tokens: asyncio.Queue[tuple[int, list[int] | None]] | None,
        tenant: Tenant | None,
    ) -> list[asyncio.Future[Completion]]:
        """Send the ``n`` generations to the engine. With ``tokens``, each choice's sampled ids are put on it
        as ``(choice, ids)`` while the engine samples them (engines with ``streams_tokens``), then
        ``(choice, None)`` once its completion is ready. A tenant's futures are its own (``revoke`` cancels
        them)."""
        if tenant is not None and tenant.revoked:
            raise _revoked()
        if len(prompt) >= ctx:
            raise ApiError(
                400,
                f"the prompt is {len(prompt)} tokens but the model's context holds {ctx} (prompt and "
                "completion together); shorten the messages or start a new session",
                "messages",
            )
        max_new = min(req.max_tokens or cfg.default_max_tokens, ctx - len(prompt))
        stop_ids = [] if req.ignore_eos else [int(t) for t in chat_format.stop_token_ids]
        loop = asyncio.get_running_loop()
        futures = []
        for i in range(req.n):
            params = SamplingParams(
                max_new_tokens=max_new,
                temperature=req.temperature,
                top_p=req.top_p,
                stop_token_ids=list(stop_ids),
                seed=None if req.seed is None else req.seed + i,
                top_logprobs=req.top_logprobs if req.logprobs else 0,
            )
            greq = GenerationRequest(list(prompt), params)
            if tokens is not None and live:

                def observe(ids: list[int], i: int = i, q: Any = tokens) -> None:  # engine loop thread
                    loop.call_soon_threadsafe(q.put_nowait, (i, ids))

                fut = asyncio.wrap_future(engine.submit(greq, on_tokens=observe))
            else:
                fut = asyncio.wrap_future(engine.submit(greq))
            if tokens is not None:
                fut.add_done_callback(lambda _f, i=i, q=tokens: q.put_nowait((i, None)))
            if tenant is not None:
                tenant.futures.add(fut)
                fut.add_done_callback(tenant.futures.discard)
            futures.append(fut)
        return futures

    async def _collect(
        futures: list[asyncio.Future[Completion]],
        req: ChatRequest,
        forced: list[int],
        tenant: Tenant | None,
        request: Request,
    ) -> tuple[list[Turn], list[str]]:
        """A non-streamed request's completions. Its generations are cancelled (engines drop or stop them)
        when the client disconnects meanwhile (499, nothing recorded), when ``request_timeout_s`` passes
        (504) and when its tenant key is revoked (401)."""
        gathered = asyncio.gather(*futures)
        # When the generations are cancelled below, gather ends holding their CancelledError, which asyncio
        # logged at ERROR ("exception was never retrieved") for every client that left: read it here.
        gathered.add_done_callback(lambda f: f.cancelled() or f.exception())
        gone = asyncio.ensure_future(_disconnect(request))
        try:
            finished, _ = await asyncio.wait(
                {gathered, gone}, timeout=cfg.request_timeout_s, return_when=asyncio.FIRST_COMPLETED
            )
            if gathered in finished:
                done: list[Completion] = gathered.result()
            elif gone in finished:
                raise _gone("while its answer was generated")
            else:
                raise _timeout()
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if tenant is not None and tenant.revoked and not (task is not None and task.cancelling()):
                raise _revoked() from None  # its futures were cancelled by revoke, not this handler
            raise
        finally:
            gone.cancel()
            for f in futures:
                f.cancel()  # no-op when done; an abandoned request is dropped or stopped by the engine
        return _turns(done, req, forced)

    async def _disconnect(request: Request) -> None:
        """Returns when the client of ``request`` (body already read) disconnects."""
        while (await request.receive())["type"] != "http.disconnect":
            pass

    def _timeout() -> ApiError:
        st.counters["timeout"] += 1
        return ApiError(504, f"generation took longer than request_timeout_s={cfg.request_timeout_s}")

    def _turns(done: list[Completion], req: ChatRequest, forced: list[int]) -> tuple[list[Turn], list[str]]:
        failed = [c for c in done if c.finish_reason == "error"]
        if failed:
            st.counters["engine_error"] += 1
            healthy = engine.health().get("ok", True)
            raise ApiError(500 if healthy else 503, f"the engine failed this request: {failed[0].error}")
        pairs = [to_turn(c, req, chat_format, decode, forced) for c in done]
        return [p[0] for p in pairs], [p[1] for p in pairs]

    async def _produce(
        req: ChatRequest,
        forced: list[int],
        futures: list[asyncio.Future[Completion]],
        tokens: asyncio.Queue[tuple[int, list[int] | None]],
        builder: ResponseBuilder,
        session: Session | None,
        plan: Plan | None,
        out: asyncio.Queue[str | None],
        tenant: Tenant | None,
    ) -> None:
        """One streamed answer, run as its own task so it completes (and the session lock is released)
        whether or not the client keeps reading. Errors after the first chunk become an error event."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + cfg.request_timeout_s
        streams = [ContentStream(forced, req, chat_format, decode) for _ in range(req.n)]
        t0 = time.perf_counter()
        try:
            for i in range(req.n):
                out.put_nowait(builder.head(i))
            left = req.n
            while left:
                try:
                    i, ids = await asyncio.wait_for(tokens.get(), max(0.0, deadline - loop.time()))
                except TimeoutError:
                    raise _timeout() from None
                if ids is None:
                    left -= 1
                elif text := streams[i].push(ids):
                    out.put_nowait(builder.delta(i, text))
            if any(f.cancelled() for f in futures):
                raise _revoked()  # only revoke cancels a stream's futures before they are done
            turns, finishes = _turns([f.result() for f in futures], req, forced)
            extra = _commit(session, plan, req, turns, time.perf_counter() - t0)
            for chunk in builder.tail(turns, finishes, extra, [s.sent for s in streams]):
                out.put_nowait(chunk)
        except ApiError as e:
            body = {"error": {"message": e.message, "type": _TYPES.get(e.status, "error"), "param": e.param}}
            out.put_nowait(f"data: {json.dumps(body)}\n\n")
        except Exception as e:  # noqa: BLE001 - a bug: report it on the stream, keep serving
            st.counters["engine_error"] += 1
            body = {"error": {"message": f"internal error: {type(e).__name__}: {e}", "type": "server_error"}}
            out.put_nowait(f"data: {json.dumps(body)}\n\n")
        finally:
            for f in futures:
                f.cancel()  # no-op when done; a timed-out generation is abandoned
            if session is not None:
                st.sessions.release(session)  # forgets it when its first request failed
            st.in_flight -= 1
            if tenant is not None:
                tenant.in_flight -= 1
            out.put_nowait(None)

    async def _drain(out: asyncio.Queue[str | None], producer: asyncio.Task) -> AsyncIterator[str]:
        """The stream's chunks. A client that hangs up before the last one (Starlette then cancels this
        generator) has its producer cancelled: generations stopped, nothing recorded."""
        complete = False
        try:
            while (chunk := await out.get()) is not None:
                yield chunk
            complete = True
        finally:
            if not complete and not producer.done():
                st.counters["disconnected"] += 1
                producer.cancel()

    return app

"""The FastAPI app of ``specrt serve``: ``POST /v1/completions`` and ``POST
/v1/chat/completions`` (JSON or server-sent events), ``GET /v1/models[/{id}]``, ``GET
/metrics`` (Prometheus), ``GET /health``, ``GET /docs``, over a
:class:`~specrt.runtime.serve.service.CompletionService`.

The event loop only parses JSON (bodies are capped: 413 above ``max_body_bytes``) and moves
events; validation, chat-template rendering, tokenization and the detokenization of logprob
listings run in the loop's default executor, so a large prompt never stalls ``/health`` or
other streams. A refused request gets one OpenAI error object before anything is queued. A
client that disconnects (streaming or not) sets its jobs' ``cancelled`` events.

FastAPI, uvicorn, pydantic and prometheus_client are the optional ``[serve]`` extra: they
are imported only inside functions, so the base runtime imports without them.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
from typing import Sequence

from ..errors import InputError
from .jobs import Job, ServeError, ServerBusy
from .protocol import chat_request_model, completion_request_model, field_names, validation_message
from .responses import Work, error_body
from .service import CompletionService, RequestError
from .settings import DEFAULT_MAX_BODY_BYTES
from .tools import ToolStream

__all__ = ["create_app", "require_serve_extra"]


# ---- the ASGI app (FastAPI) ----------------------------------------------------------
def require_serve_extra() -> None:
    """Raises ServeError naming the missing ``[serve]`` package."""
    try:
        import fastapi  # noqa: F401
        import prometheus_client  # noqa: F401
        import pydantic  # noqa: F401
    except ImportError as e:
        raise ServeError(
            f"serving needs the [serve] extra (FastAPI, uvicorn, jinja2, prometheus_client): pip install -e '.[serve]' in the specrt checkout ({e})"
        ) from None


class _ApiKey:
    """ASGI middleware: ``/v1/*`` requests need ``Authorization: Bearer KEY`` (else 401
    with OpenAI's ``invalid_api_key`` error); other routes and CORS preflights pass."""

    def __init__(self, app, key: str, metrics):
        self.app, self.expected, self.metrics = app, f"Bearer {key}".encode(), metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1") and scope["method"] != "OPTIONS":
            got = dict(scope.get("headers") or []).get(b"authorization", b"")
            if not hmac.compare_digest(got, self.expected):
                self.metrics.count("invalid")
                msg = (
                    "Incorrect API key provided"
                    if got
                    else "You didn't provide an API key. You need to provide your API key in an Authorization header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY)"
                )
                await _send_json(send, 401, error_body(msg, None, "invalid_request_error", "invalid_api_key"), [(b"www-authenticate", b"Bearer")])
                return
        await self.app(scope, receive, send)


class _BodyLimit:
    """ASGI middleware: a request body above ``limit`` bytes gets 413 before the app parses
    it (by ``Content-Length`` at once, else while it arrives); the body is then replayed."""

    def __init__(self, app, limit: int, metrics):
        self.app, self.limit, self.metrics = app, limit, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        length = dict(scope.get("headers") or []).get(b"content-length")
        too_big = length is not None and length.isdigit() and int(length) > self.limit
        messages, size = [], 0
        while not too_big:
            msg = await receive()
            messages.append(msg)
            if msg["type"] != "http.request":
                break
            size += len(msg.get("body", b""))
            too_big = size > self.limit
            if not msg.get("more_body", False):
                break
        if too_big:
            self.metrics.count("invalid")
            await _send_json(
                send,
                413,
                error_body(
                    f"request body is larger than {self.limit} bytes (the server's --max-body-bytes)", None, "invalid_request_error", "request_too_large"
                ),
            )
            return

        async def replay():
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replay, send)


async def _send_json(send, status: int, body: dict, headers=()) -> None:
    data = json.dumps(body).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()), *headers],
        }
    )
    await send({"type": "http.response.body", "body": data})


def create_app(service: CompletionService, api_key: str | None = None, allowed_origins: Sequence[str] = (), max_body_bytes: int = DEFAULT_MAX_BODY_BYTES):
    """The FastAPI app serving ``service``; every error is OpenAI's JSON error object.

    Args:
        service: the :class:`CompletionService`.
        api_key: when set, ``/v1/*`` needs ``Authorization: Bearer <api_key>`` (401 otherwise).
        allowed_origins: browser origins allowed by CORS (Starlette's ``CORSMiddleware``;
            ``"*"`` = any); empty = no CORS headers.
        max_body_bytes: larger request bodies get 413 unparsed.

    Raises:
        ServeError: the ``[serve]`` extra is not installed, or ``max_body_bytes`` < 1.
    """
    require_serve_extra()
    from fastapi import FastAPI, Request
    from fastapi.middleware.cors import CORSMiddleware
    from fastapi.responses import JSONResponse, StreamingResponse

    if max_body_bytes < 1:
        raise ServeError(f"max_body_bytes={max_body_bytes}; it must be >= 1")
    CompletionRequest, ChatRequest = completion_request_model(), chat_request_model()
    metrics = service.metrics
    app = FastAPI(title="specrt", summary="OpenAI-compatible completions and chat completions with speculative decoding", version="1")
    app.state.service = service
    fields = {"/v1/completions": field_names(CompletionRequest), "/v1/chat/completions": field_names(ChatRequest)}
    err = _install_error_handlers(app, metrics, fields)

    async def handle(body, request: Request, prepare):
        """Validate (off the loop), queue, then answer JSON or server-sent events."""
        t0 = time.perf_counter()
        loop = asyncio.get_running_loop()
        work = await loop.run_in_executor(None, prepare, body)
        jobs, events = service.submit(work)
        cid, created = service.new_id(work.chat), int(time.time())
        if work.stream:
            return StreamingResponse(
                _sse(service, work, jobs, events, cid, created, t0),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        kind, payload = await _collect(events, request, jobs)
        if kind == "done":
            body = await loop.run_in_executor(None, service.responses.response_body, work, cid, created, payload, jobs)
            _record(service, work, jobs, payload, t0)
            return JSONResponse(body)
        if kind == "cancelled":
            metrics.count("cancelled")
            return err(499, "request cancelled", None, "cancelled")
        return _error_response(metrics, payload, err)

    async def completions(body, request: Request):
        """OpenAI ``/v1/completions``: JSON, or server-sent events with ``stream: true``."""
        return await handle(body, request, service.prepare_completion)

    async def chat_completions(body, request: Request):
        """OpenAI ``/v1/chat/completions``: the conversation rendered with the model's chat
        template; JSON, or server-sent ``chat.completion.chunk`` events with ``stream: true``."""
        return await handle(body, request, service.prepare_chat)

    # the body models are built at run time (pydantic is optional) and this module uses
    # postponed annotations: give FastAPI the real classes
    completions.__annotations__.update(body=CompletionRequest, request=Request)
    chat_completions.__annotations__.update(body=ChatRequest, request=Request)
    errors_doc = _error_responses()
    app.post("/v1/completions", responses=errors_doc)(completions)
    app.post("/v1/chat/completions", responses=errors_doc)(chat_completions)

    _add_info_routes(app, service, errors_doc)
    _document_400(app)
    app.add_middleware(_BodyLimit, limit=max_body_bytes, metrics=metrics)
    if api_key:
        app.add_middleware(_ApiKey, key=api_key, metrics=metrics)
    if allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["*"], allow_headers=["*"])
    return app


def _add_info_routes(app, service: CompletionService, errors_doc: dict) -> None:
    """``GET /v1/models``, ``/v1/models/{id}``, ``/metrics`` and ``/health`` on ``app``."""
    from fastapi.responses import Response

    metrics = service.metrics

    def model_card():
        return {"id": service.model_name, "object": "model", "created": service.created, "owned_by": "specrt", "max_model_len": service.engine.manifest.max_ctx}

    @app.get("/v1/models")
    async def models():
        """OpenAI ``/v1/models``: the one model this server serves (``created`` = server start)."""
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}", responses={404: errors_doc[404]})
    async def model(model_id: str):
        """OpenAI ``/v1/models/{id}``: the model, or 404 ``model_not_found``."""
        service.check_model(model_id)
        return model_card()

    @app.get("/metrics")
    async def prom_metrics():
        """Prometheus text exposition (prometheus_client)."""
        return Response(metrics.render(), media_type=metrics.content_type)

    @app.get("/health")
    async def health():
        """Liveness plus the worker and queue figures."""
        return {
            "status": "ok",
            "model": service.model_name,
            "workers": service.pool.workers,
            "busy": service.pool.busy,
            "queued": service.pool.queued,
            **metrics.snapshot(),
        }


def _error_responses() -> dict:
    """OpenAPI ``responses`` of the POST routes: OpenAI's error object per status."""
    from pydantic import BaseModel

    class ErrorDetail(BaseModel):
        """OpenAI's error fields."""

        message: str
        type: str
        param: str | None = None
        code: str | None = None

    class ErrorResponse(BaseModel):
        """OpenAI's error object."""

        error: ErrorDetail

    doc = {
        400: "invalid request: JSON, a field's type or range, an unsupported value, or what the engine refuses (the message names the field)",
        401: "missing or wrong API key (only with --api-key)",
        404: "model not served here (code model_not_found)",
        413: "request body larger than --max-body-bytes",
        503: "queue full (type server_busy, Retry-After: 1)",
    }
    return {k: {"model": ErrorResponse, "description": v} for k, v in doc.items()}


def _document_400(app) -> None:
    """The OpenAPI schema says what the server answers: FastAPI documents 422 for body
    validation, this server answers 400 with OpenAI's error object, so 422 is dropped."""
    from fastapi.openapi.utils import get_openapi

    def openapi():
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, summary=app.summary, routes=app.routes)
            for ops in schema.get("paths", {}).values():
                for op in ops.values():
                    op.get("responses", {}).pop("422", None)
            comps = schema.get("components", {}).get("schemas", {})
            for name in ("HTTPValidationError", "ValidationError"):
                comps.pop(name, None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi


def _install_error_handlers(app, metrics, fields: dict[str, list[str]]):
    """OpenAI-style JSON errors for validation failures, refusals, a full queue and unknown
    routes; returns ``err(status, message, param, type, headers, code)`` building such a response."""
    from fastapi import Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException

    def err(status: int, message: str, param=None, err_type="invalid_request_error", headers=None, code=None):
        return JSONResponse(error_body(message, param, err_type, code), status_code=status, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        metrics.count("invalid")
        msg, param = validation_message(list(exc.errors()), fields.get(request.url.path, []))
        return err(400, msg, param)

    @app.exception_handler(RequestError)
    async def _refused(request: Request, exc: RequestError):
        metrics.count("invalid")
        return err(exc.status, str(exc), exc.param, exc.err_type, code=exc.code)

    @app.exception_handler(ServerBusy)
    async def _busy(request: Request, exc: ServerBusy):
        metrics.count("rejected")
        return err(503, str(exc), None, "server_busy", headers={"Retry-After": "1"})

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        metrics.count("invalid")  # one count per HTTP request, unknown routes and methods included
        hint = {
            404: f"no route {request.url.path}; routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /v1/models/{{id}}, GET /metrics, GET /health, GET /docs",
            405: f"method {request.method} not allowed on {request.url.path}",
        }.get(exc.status_code, str(exc.detail))
        return err(exc.status_code, hint, None, "invalid_request_error")

    return err


def _record(service: CompletionService, work: Work, jobs: list[Job], results: list, t0: float) -> None:
    """Metrics of one ok request: per generation (tokens, acceptance, queue time, time per
    output token), then the request (latency, time to first text)."""
    metrics = service.metrics
    for job, res in zip(jobs, results):
        tpot = None
        if job.first is not None and job.finished is not None and len(res.tokens) > 1:
            tpot = (job.finished - job.first) / (len(res.tokens) - 1)
        qt = None if job.started is None else job.started - job.enqueued
        metrics.generation(res.stats, res.finish_reason if job.generate else None, qt, tpot)
    firsts = [j.first for j in jobs if j.first is not None]
    metrics.request_done(time.perf_counter() - t0, min(firsts) - t0 if firsts else None)


def _error_response(metrics, exc: Exception, err):
    """A generation that raised: 400 for the project's input errors, else 500."""
    if isinstance(exc, InputError):
        metrics.count("invalid")
        return err(400, str(exc), exc.param)
    metrics.count("error")
    return err(500, f"generation failed: {type(exc).__name__}: {exc}", None, "server_error")


async def _wait_disconnect(request) -> None:
    """Return when the client has gone (``http.disconnect``); the body was already read."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _collect(events: asyncio.Queue, request, jobs: list[Job]) -> tuple:
    """Every job's result (``("done", [results])``), or ``("cancelled", None)`` after
    cancelling them when the client disconnects first, or ``("error", exception)`` at the
    first failed generation (the others are cancelled)."""
    gone = asyncio.ensure_future(_wait_disconnect(request))
    results: list = [None] * len(jobs)
    pending = len(jobs)
    try:
        while pending:
            get = asyncio.ensure_future(events.get())
            done, _ = await asyncio.wait({get, gone}, return_when=asyncio.FIRST_COMPLETED)
            if get not in done:
                get.cancel()
                return ("cancelled", None)  # the workers drop the jobs at their next piece (or skip them)
            i, (kind, payload) = get.result()
            if kind == "done":
                results[i] = payload
                pending -= 1
            elif kind in ("cancelled", "error"):
                return (kind, payload)
        return ("done", results)
    finally:
        for j in jobs:
            j.cancelled.set()  # no-op once a job is done; cancels the rest
        gone.cancel()


async def _sse(service: CompletionService, work: Work, jobs: list[Job], events: asyncio.Queue, cid: str, created: int, t0: float):
    """Server-sent events for one streamed request (every choice interleaved, each chunk
    naming its ``index``); cancels the jobs if the client goes (Starlette cancels this
    generator on ``http.disconnect``).

    Per choice: chat sends a first chunk with ``delta.role``; completions with ``echo``
    send the prompt (and its logprobs) first; then text pieces; then a chunk with the
    ``finish_reason``. Logprob entries travel with the piece of the round that committed
    their tokens (their text may be held back to a later piece: UTF-8 boundaries, possible
    stop-string starts). With tools, the text goes through a
    :class:`~specrt.runtime.serve.tools.ToolStream`: content deltas, then each call as
    ``delta.tool_calls`` once it is complete, and ``finish_reason`` ``"tool_calls"``."""
    metrics = service.metrics
    loop = asyncio.get_running_loop()
    results: list = [None] * len(jobs)
    seen: list[list[int]] = [[] for _ in jobs]  # output ids sent so far per choice (text offsets)
    left = len(jobs)
    ended = False
    tools = [ToolStream(work.tools.format) for _ in jobs] if work.tools is not None else None  # tool calls read back per choice

    try:
        if work.chat:
            for i in range(len(jobs)):
                yield service.responses.chunk(work, cid, created, i, role=True)
        while left:
            i, (kind, payload) = await events.get()
            if kind == "prompt":
                yield await loop.run_in_executor(None, service.responses.prompt_chunk, work, cid, created, i, payload)
            elif kind == "text":
                piece, entries = payload
                lp = None
                if work.top_n is not None:
                    lp = await loop.run_in_executor(None, service.responses.piece_logprobs, work, i, entries, seen[i])
                if tools is None:
                    yield service.responses.chunk(work, cid, created, i, piece, None, lp)
                    continue
                for j, delta in enumerate(tools[i].push(piece) or ([{}] if lp else [])):
                    yield service.responses.chunk(work, cid, created, i, None, None, lp if j == 0 else None, delta=delta)
            elif kind == "done":
                results[i] = payload
                left -= 1
                rest = payload.logprobs[jobs[i].lp_sent :] if payload.logprobs is not None and work.top_n is not None else None
                lp = await loop.run_in_executor(None, service.responses.piece_logprobs, work, i, rest, seen[i]) if rest else None
                finish = payload.finish_reason
                if tools is not None:
                    for delta in tools[i].finish(finish == "length"):
                        yield service.responses.chunk(work, cid, created, i, None, None, None, delta=delta)
                    finish = "tool_calls" if tools[i].calls and finish == "stop" else finish
                yield service.responses.chunk(work, cid, created, i, "", finish, lp)
            else:
                ended = True
                if kind == "cancelled":
                    metrics.count("cancelled")
                    yield f"data: {json.dumps(error_body('request cancelled', None, 'cancelled'))}\n\n"
                elif isinstance(payload, InputError):
                    metrics.count("invalid")
                    yield f"data: {json.dumps(error_body(str(payload), payload.param))}\n\n"
                else:
                    metrics.count("error")
                    yield f"data: {json.dumps(error_body(f'generation failed: {type(payload).__name__}: {payload}', None, 'server_error'))}\n\n"
                yield "data: [DONE]\n\n"
                return
        ended = True
        _record(service, work, jobs, results, t0)
        if work.include_usage:
            yield service.responses.usage_chunk(work, cid, created, results)
        yield "data: [DONE]\n\n"
    finally:
        for j in jobs:
            j.cancelled.set()
        if not ended:
            metrics.count("cancelled")  # the client left mid-stream

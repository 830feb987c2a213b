"""The FastAPI application: routes, the bearer token, the bounds, OpenAI's error JSON.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (``stream``: server-sent
events) and ``GET /v1/models`` (the token models served here). Each request is:

- authenticated with the gRPC API's tokens (``api.auth``: ``Authorization: Bearer
  <token>`` looked up in ``--auth-tokens``; without that file nobody is asked): no known
  token is a 401, a role that may not call Generate (ListModels for ``/v1/models``) a
  403; a client's sessions are its tenant's, as over gRPC;
- bounded: a body over ``max_body_bytes`` is a 413 before it is read whole, more than
  ``max_requests`` requests at once a 429 (a stream counts until it ends);
- checked before anything runs: a body that is not a valid request is a 400 naming the
  field (``param``), as every refusal is, in OpenAI's ``{"error": {...}}``.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ssmserve.server.api.auth import ALLOWED, SESSION_SERVICE, Authenticator
from ssmserve.server.api.tenancy import TenantScope
from ssmserve.server.errors import SsmserveError
from ssmserve.server.http import protocol
from ssmserve.server.http.completions import Completions, Prepared
from ssmserve.server.http.errors import HttpError, from_error, internal
from ssmserve.server.http.protocol import ChatCompletionRequest, CompletionRequest
from ssmserve.server.http.runs import Caller


class Limits:
    """Requests in flight, at most ``max_requests`` (no queue: a 429 past it)."""

    def __init__(self, max_requests: int) -> None:
        self.max_requests = max_requests
        self.running = 0

    def enter(self) -> None:
        if self.running >= self.max_requests:
            raise HttpError(
                429,
                f"this server runs at most {self.max_requests} requests at once; retry shortly",
                "rate_limit_error",
                None,
                "too_many_requests",
            )
        self.running += 1

    def leave(self) -> None:
        self.running -= 1


class BodyLimit:
    """ASGI middleware: a request body over ``max_bytes`` is a 413, refused by its
    Content-Length when it gives one, else as soon as that many bytes have arrived."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        too_large = HttpError(
            413,
            f"the request body is over this server's limit of {self.max_bytes} bytes",
            "invalid_request_error",
            None,
            "request_too_large",
        )
        for name, value in scope.get("headers", ()):
            if name == b"content-length" and value.isdigit() and int(value) > self.max_bytes:
                await _send_error(send, too_large)
                return
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise _BodyTooLarge(too_large)
            return message

        try:
            await self.app(scope, counted, send)
        except _BodyTooLarge as exc:
            await _send_error(send, exc.error)


class _BodyTooLarge(Exception):
    def __init__(self, error: HttpError) -> None:
        self.error = error


async def _send_error(send: Send, error: HttpError) -> None:
    body = error.json().encode()
    await send(
        {
            "type": "http.response.start",
            "status": error.status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


def build_app(
    completions: Completions,
    authenticator: Authenticator,
    limits: Limits,
    max_body_bytes: int,
) -> ASGIApp:
    """The door's ASGI application."""
    app = FastAPI(title="ssmserve", docs_url=None, redoc_url=None, openapi_url=None)
    started = int(time.time())

    def caller_of(request: Request, method: str) -> Caller:
        if not authenticator.enabled:
            return Caller(None, TenantScope())
        header = request.headers.get("authorization", "")
        who = authenticator.principal([("authorization", header)])
        if who is None:
            raise HttpError(
                401,
                "a known token is needed: send 'Authorization: Bearer <token>' (the "
                "worker's --auth-tokens)",
                "authentication_error",
                None,
                "invalid_api_key",
            )
        if SESSION_SERVICE + method not in ALLOWED[who.role]:
            raise HttpError(
                403,
                f"role {who.role.value} may not call {method}",
                "permission_error",
                None,
                "permission_denied",
            )
        return Caller(who, TenantScope.of(who))

    @app.exception_handler(HttpError)
    async def http_error(_request: Request, exc: HttpError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def invalid(_request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        where = [str(p) for p in first.get("loc", ()) if p != "body"]
        param = where[0] if where else None  # the request's field (not a union member's type)
        message = f"{'.'.join(where) or 'body'}: {first.get('msg', 'invalid request')}"
        error = HttpError(400, message[:500], "invalid_request_error", param, None)
        return JSONResponse(error.body(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def routing(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # An unknown route (404) or method (405): in OpenAI's shape too.
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        error = HttpError(exc.status_code, str(exc.detail), kind, None, None)
        return JSONResponse(error.body(), status_code=exc.status_code)

    @app.exception_handler(SsmserveError)
    async def typed(_request: Request, exc: SsmserveError) -> JSONResponse:
        error = from_error(exc)
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(Exception)
    async def bug(_request: Request, exc: Exception) -> JSONResponse:
        error = internal(exc)
        return JSONResponse(error.body(), status_code=error.status)

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        caller_of(request, "ListModels")
        manager = completions.manager
        keys = sorted(k for k, m in manager.models.items() if m.config.is_token_model)
        return JSONResponse(protocol.model_list(keys, started))

    @app.post("/v1/completions", response_model=None)
    async def complete(body: CompletionRequest, request: Request) -> Any:
        caller = caller_of(request, "Generate")
        return await _run(body.stream, caller, lambda: completions.prepare_completion(body, caller))

    @app.post("/v1/chat/completions", response_model=None)
    async def chat(body: ChatCompletionRequest, request: Request) -> Any:
        caller = caller_of(request, "Generate")
        return await _run(body.stream, caller, lambda: completions.prepare_chat(body, caller))

    async def _run(stream: bool, caller: Caller, prepare: Callable[[], Awaitable[Prepared]]) -> Any:
        limits.enter()
        handed = False  # a stream's events leave the limit when they end
        try:
            prepared = await prepare()
            if not stream:
                return JSONResponse(await completions.answer(prepared, caller))
            updates = completions.updates(prepared, caller)
            try:
                first = await anext(updates)  # a refusal is still an HTTP status
            except BaseException:
                await updates.aclose()
                raise
            events = _events(completions.stream(prepared, caller, first, updates), updates, limits)
            handed = True  # from here ``events`` leaves the limit, however the stream ends
            head = await anext(events)
            return StreamingResponse(
                _sent(head, events),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        finally:
            if not handed:
                limits.leave()

    return BodyLimit(app, max_body_bytes)


async def _events(
    events: AsyncGenerator[str, None], updates: AsyncGenerator[Any, None], limits: Limits
) -> AsyncGenerator[str, None]:
    """The stream's events; when it ends (or the client goes away) the generation is
    closed (its session kept or closed) and the request leaves the limit. It is started
    (its first event taken) before the response is handed over: a started generator is
    closed even when the response never sends it (the client left first), as Python
    finalizes one that is dropped."""
    try:
        async for event in events:
            yield event
    finally:
        try:
            await events.aclose()
            await updates.aclose()
        finally:
            limits.leave()


async def _sent(head: str, events: AsyncGenerator[str, None]) -> AsyncIterator[str]:
    """``head``, then the rest of ``events`` (closed however the response ends)."""
    try:
        yield head
        async for event in events:
            yield event
    finally:
        await events.aclose()

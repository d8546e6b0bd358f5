"""The OpenAI-compatible HTTP API of one router: a FastAPI app over its RouterCore.

    POST /v1/completions, /v1/chat/completions   generation (SSE when stream=true)
    GET  /v1/models                              the served model
    POST /tokenize                               a text's token ids (vLLM's endpoint)
    GET  /health                                 200 while the scheduler is SERVING, else 503
    GET  /version                                the server's version

/v1/* authenticate as the gRPC API does (`authorization: Bearer <key>` with --api-key-file);
/health and /version answer anyone (probes), and tell nothing else.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from fastapi import Depends, FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services.common.auth import Authenticator, CallCredentials, Principal, bearer_of
from services.common.errors import ConveyorError, PipelineUnavailable
from services.common.sampling import SamplingParams
from services.router.core import RouterCore
from services.router.http import convert, endpoints, schemas
from services.router.http.errors import (
    BodyTimeout,
    BodyTooLarge,
    ServerBusy,
    error_response,
    on_client_gone,
    on_conveyor_error,
    on_http_error,
    on_validation_error,
)
from services.router.http.streaming import ClientGone
from services.router.kserve import SERVER_VERSION
from services.router.request import GenerateInput

if TYPE_CHECKING:
    from prometheus_client import Counter

ENDPOINTS = (
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/models",
    "/tokenize",
    "/health",
    "/version",
)


BODY_TIMEOUT_S = 30.0
"""A request body not whole this long after its head is refused (408): a body trickled in
would otherwise hold one of the requests in flight for as long as its sender likes."""
UNLIMITED_PATHS = ("/health", "/version")
"""Probes answer however busy the router is (a liveness probe must not restart it for that)."""


def create_app(
    core: RouterCore,
    authenticator: Authenticator,
    max_body_bytes: int,
    max_requests: int | None = None,
) -> FastAPI:
    """The app; requests count in core.metrics when metrics are on; with `max_requests`,
    one more request in flight is refused (503, Retry-After)."""
    app = FastAPI(
        title="Conveyor", version=SERVER_VERSION, docs_url=None, redoc_url=None, openapi_url=None
    )
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(ConveyorError, on_conveyor_error)
    app.add_exception_handler(ClientGone, on_client_gone)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_middleware(LimitBody, max_bytes=max_body_bytes)
    if max_requests is not None:
        app.add_middleware(LimitRequests, max_requests=max_requests)
    if core.metrics is not None:
        app.add_middleware(CountRequests, counter=core.metrics.http_requests)

    def principal(request: Request) -> Principal:
        headers = request.headers.getlist("authorization")
        bearer = bearer_of([("authorization", h) for h in headers])
        return authenticator.authenticate(CallCredentials(bearer=bearer))

    @app.post("/v1/completions", response_model=schemas.CompletionResponse)
    async def completions(
        body: schemas.CompletionRequest, request: Request, who: Principal = Depends(principal)
    ) -> Response:
        return await endpoints.completions(core, request, body, who)

    @app.post("/v1/chat/completions", response_model=schemas.ChatCompletionResponse)
    async def chat_completions(
        body: schemas.ChatCompletionRequest, request: Request, who: Principal = Depends(principal)
    ) -> Response:
        return await endpoints.chat_completions(core, request, body, who)

    @app.get("/v1/models", dependencies=[Depends(principal)])
    async def models() -> schemas.ModelList:
        card = schemas.ModelCard(
            id=core.limits.name, created=0, max_model_len=core.limits.max_model_len
        )
        return schemas.ModelList(data=[card])

    @app.post("/tokenize", dependencies=[Depends(principal)])
    async def tokenize(body: schemas.TokenizeRequest) -> schemas.TokenizeResponse:
        convert.check_model(body.model, core.limits)
        ids = await core.tokenize(GenerateInput(sampling=SamplingParams(), text=body.prompt))
        return schemas.TokenizeResponse(
            tokens=ids, count=len(ids), max_model_len=core.limits.max_model_len
        )

    @app.get("/openapi.json", dependencies=[Depends(principal)], include_in_schema=False)
    async def openapi() -> dict:
        """The API's schema, for a caller who may use the API (FastAPI's own is open)."""
        return app.openapi()

    @app.get("/health")
    async def health() -> Response:
        if not core.is_ready:
            return error_response(
                PipelineUnavailable("the scheduler is not serving (no whole pipeline yet)")
            )
        return JSONResponse({"status": "ok"})

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": SERVER_VERSION}

    return app


class LimitRequests:
    """Refuses a request beyond `max_requests` in flight (503 with OpenAI's body and
    Retry-After: 1; --max-concurrent-rpcs, as for gRPC). Only requests count, not open
    connections: an idle connection holds nothing (server.py closes it)."""

    def __init__(self, app: ASGIApp, max_requests: int):
        self.app = app
        self.max_requests = max_requests
        self.num_requests = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in UNLIMITED_PATHS:
            return await self.app(scope, receive, send)
        if self.num_requests >= self.max_requests:
            busy = ServerBusy(
                f"the router serves {self.max_requests} HTTP requests already "
                "(--max-concurrent-rpcs): retry shortly"
            )
            return await error_response(busy)(scope, receive, send)
        self.num_requests += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.num_requests -= 1


class LimitBody:
    """Refuses a request body over `max_bytes` (413) whether or not it declares its length,
    before the JSON parser sees it (--max-message-bytes, as for gRPC messages), and one
    that is not whole within BODY_TIMEOUT_S (408)."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    def _too_large(self) -> BodyTooLarge:
        return BodyTooLarge(
            f"the request body is larger than {self.max_bytes} bytes (--max-message-bytes)"
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await error_response(self._too_large())(scope, receive, send)
        num_bytes, is_refused, is_whole = 0, False, False
        deadline = asyncio.get_running_loop().time() + BODY_TIMEOUT_S

        async def refuse(exc: Exception) -> Message:
            nonlocal is_refused
            is_refused = True
            await error_response(exc)(scope, receive, send)
            return {"type": "http.disconnect"}

        async def counted() -> Message:
            """The body's chunks; past the limit or the deadline, the error goes out and the
            app sees a client that went away (whatever it answers then is dropped)."""
            nonlocal num_bytes, is_whole
            if is_refused:
                return {"type": "http.disconnect"}
            if is_whole:  # after the body: waits for a disconnect, as long as it takes
                return await receive()
            try:
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                return await refuse(
                    BodyTimeout(f"the request body did not arrive within {BODY_TIMEOUT_S:g} s")
                )
            is_whole = not message.get("more_body", False)
            num_bytes += len(message.get("body", b""))
            if num_bytes > self.max_bytes:
                return await refuse(self._too_large())
            return message

        async def unless_refused(message: Message) -> None:
            if not is_refused:
                await send(message)

        await self.app(scope, counted, unless_refused)


class CountRequests:
    """`conveyor:http_requests_total{endpoint, status}`: every HTTP request by its status."""

    def __init__(self, app: ASGIApp, counter: Counter):
        self.app = app
        self.counter = counter

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = 500  # unless a response starts

        async def observed(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, observed)
        finally:
            path = scope["path"] if scope["path"] in ENDPOINTS else "other"
            self.counter.labels(path, str(status)).inc()

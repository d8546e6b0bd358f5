"""POST /v1/completions and /v1/chat/completions over RouterCore (the gRPC API's path).

Each choice is one core request (validated, tokenized and streamed by the core, aborted by
it when the client goes). A streamed response starts only once the first output is there,
so that a request the scheduler refuses (queue full, pipeline down) gets its HTTP status
(429, 503) instead of a 200 whose stream carries the error.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from services.common.auth import Principal
from services.common.errors import ConveyorError
from services.common.sampling import SamplingParams
from services.router.core import RouterCore
from services.router.http import convert, schemas
from services.router.http.errors import error_body
from services.router.http.shapes import ChatShape, CompletionShape, Shape
from services.router.http.streaming import (
    DONE_EVENT,
    gather_all,
    merge,
    sse_event,
    unless_disconnected,
)
from services.router.output import OutputDelta
from services.router.request import GenerateInput, PreparedRequest


async def completions(
    core: RouterCore, request: Request, body: schemas.CompletionRequest, principal: Principal
) -> Response:
    convert.check_model(body.model, core.limits)
    inputs = convert.completion_inputs(body, core.limits.max_stream_requests)
    prepared = await _prepare(core, request, inputs, principal)
    shape = CompletionShape(
        model=core.limits.name,
        tokenizer=core.tokenizer,
        prepared=prepared,
        n=body.n,
        wants_logprobs=body.logprobs is not None,
        echo=body.echo,
    )
    return await _respond(core, request, body, shape)


async def chat_completions(
    core: RouterCore, request: Request, body: schemas.ChatCompletionRequest, principal: Principal
) -> Response:
    convert.check_model(body.model, core.limits)
    convert.check_supported(body)
    convert.check_choices(1, body.n, core.limits.max_stream_requests)
    max_tokens = convert.requested_max_tokens(body)
    if max_tokens is None:  # OpenAI's default: whatever room the context leaves
        chat = GenerateInput(sampling=SamplingParams(), chat=convert.chat_turns(body.messages))
        num_prompt = len(await core.tokenize(chat))
        max_tokens = max(1, core.limits.max_model_len - num_prompt)
    inputs = convert.chat_input(body, max_tokens, core.limits.max_stream_requests)
    prepared = await _prepare(core, request, inputs, principal)
    shape = ChatShape(
        model=core.limits.name,
        tokenizer=core.tokenizer,
        prepared=prepared,
        n=body.n,
        wants_logprobs=body.logprobs,
    )
    return await _respond(core, request, body, shape)


async def _prepare(
    core: RouterCore, request: Request, inputs: list[GenerateInput], principal: Principal
) -> list[PreparedRequest]:
    coros = [core.prepare(one, principal) for one in inputs]
    return await unless_disconnected(request, gather_all(coros))


async def _respond(
    core: RouterCore, request: Request, body: schemas.SamplingFields, shape: Shape
) -> Response:
    if not body.stream:
        outs = await unless_disconnected(
            request, gather_all([_collect(core, p) for p in shape.prepared])
        )
        return JSONResponse(shape.response(outs).model_dump())
    include_usage = body.stream_options is not None and body.stream_options.include_usage
    events = _events(core, shape, include_usage)
    try:
        first = await unless_disconnected(request, anext(events))
    except BaseException:
        await events.aclose()
        raise
    return StreamingResponse(_resume(first, events), media_type="text/event-stream")


async def _collect(core: RouterCore, prepared: PreparedRequest) -> list[OutputDelta]:
    return [out async for out in core.generate(prepared)]


async def _events(core: RouterCore, shape: Shape, include_usage: bool) -> AsyncIterator[bytes]:
    """Every server-sent event of a streamed response, [DONE] last."""
    # without include_usage the chunks have no usage key at all, as OpenAI's
    exclude = None if include_usage else {"usage"}
    async with contextlib.aclosing(merge([core.generate(p) for p in shape.prepared])) as outputs:
        async for index, out in outputs:
            for chunk in shape.chunk(index, out):
                yield sse_event(chunk, exclude)
    if include_usage:
        yield sse_event(shape.usage_chunk())
    yield DONE_EVENT


async def _resume(first: bytes, events: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """The stream's body: the event already read, then the rest. An error after the
    response started can only be told in the stream: an `error` event, then [DONE]."""
    try:
        yield first
        async for event in events:
            yield event
    except ConveyorError as exc:
        _, error = error_body(exc)
        yield sse_event(error)
        yield DONE_EVENT
    finally:
        await events.aclose()

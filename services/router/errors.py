"""The router's error mapping: domain exceptions to gRPC status codes, in one place.

Servicer methods are wrapped with `grpc_errors`, so core code only raises exceptions from
services/common/errors.py (or the few router-only ones below) and never touches grpc status.
"""

from __future__ import annotations

import functools
import inspect
import logging

import grpc

from services.common import errors

logger = logging.getLogger(__name__)


class RequestExists(errors.ConveyorError):
    """A request id that is already running (gRPC ALREADY_EXISTS)."""


class ModelNotFound(errors.ConveyorError):
    """A KServe model name this router does not serve (gRPC NOT_FOUND)."""


class RequestFailed(errors.ConveyorError):
    """The scheduler gave up on a request (gRPC INTERNAL, with the scheduler's reason)."""


_CODES: list[tuple[type[BaseException], grpc.StatusCode]] = [
    (errors.InvalidRequest, grpc.StatusCode.INVALID_ARGUMENT),
    (errors.ModelLoadError, grpc.StatusCode.FAILED_PRECONDITION),  # e.g. no chat template
    (errors.QueueFull, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (errors.UnknownRequest, grpc.StatusCode.NOT_FOUND),
    (ModelNotFound, grpc.StatusCode.NOT_FOUND),
    (RequestExists, grpc.StatusCode.ALREADY_EXISTS),
    (errors.PipelineUnavailable, grpc.StatusCode.UNAVAILABLE),
]


def status_for(exc: BaseException) -> grpc.StatusCode:
    """The status code of a domain exception; INTERNAL for anything else."""
    for exc_type, code in _CODES:
        if isinstance(exc, exc_type):
            return code
    return grpc.StatusCode.INTERNAL


def message_for(exc: BaseException) -> str:
    if isinstance(exc, errors.ConveyorError):
        return str(exc)
    return f"internal error in the router: {type(exc).__name__}: {exc}"


def grpc_errors(method):
    """Wraps a grpc.aio servicer method (unary or server-streaming) with the mapping."""
    if inspect.isasyncgenfunction(method):

        @functools.wraps(method)
        async def stream_wrapper(self, request, context):
            try:
                async for item in method(self, request, context):
                    yield item
            except Exception as exc:  # noqa: BLE001 - the one place errors become statuses
                await _abort(context, exc)

        return stream_wrapper

    @functools.wraps(method)
    async def unary_wrapper(self, request, context):
        try:
            return await method(self, request, context)
        except Exception as exc:  # noqa: BLE001
            await _abort(context, exc)

    return unary_wrapper


async def _abort(context: grpc.aio.ServicerContext, exc: Exception) -> None:
    if isinstance(exc, grpc.aio.AbortError):
        raise exc
    code = status_for(exc)
    if code is grpc.StatusCode.INTERNAL:
        logger.exception("unexpected error")
    await context.abort(code, message_for(exc))

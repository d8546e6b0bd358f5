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
from services.common.grpc_errors import status_for

logger = logging.getLogger(__name__)


RequestExists = errors.RequestExists
ModelNotFound = errors.ModelNotFound


class RequestFailed(errors.ConveyorError):
    """The scheduler gave up on a request (gRPC INTERNAL, with the scheduler's reason)."""


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

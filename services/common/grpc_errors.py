"""One mapping from Conveyor's domain exceptions to gRPC status codes, for every service."""

from __future__ import annotations

import grpc

from services.common import errors

_CODES: list[tuple[type[BaseException], grpc.StatusCode]] = [
    (errors.InvalidRequest, grpc.StatusCode.INVALID_ARGUMENT),
    (errors.ConfigError, grpc.StatusCode.INVALID_ARGUMENT),
    (errors.ModelLoadError, grpc.StatusCode.FAILED_PRECONDITION),  # e.g. no chat template
    (errors.QueueFull, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (errors.UnknownRequest, grpc.StatusCode.NOT_FOUND),
    (errors.ModelNotFound, grpc.StatusCode.NOT_FOUND),
    (errors.RequestExists, grpc.StatusCode.ALREADY_EXISTS),
    (errors.PipelineUnavailable, grpc.StatusCode.UNAVAILABLE),
    (errors.StateStoreError, grpc.StatusCode.UNAVAILABLE),
]


def status_for(exc: BaseException) -> grpc.StatusCode:
    """The status code for a domain exception; INTERNAL for anything unexpected."""
    for exc_type, code in _CODES:
        if isinstance(exc, exc_type):
            return code
    return grpc.StatusCode.INTERNAL


async def abort_with(context: grpc.aio.ServicerContext, exc: BaseException) -> None:
    """Ends the RPC with the mapped code and the exception's message (never a traceback)."""
    code = status_for(exc)
    message = str(exc) if code is not grpc.StatusCode.INTERNAL else f"internal error: {exc}"
    await context.abort(code, message)

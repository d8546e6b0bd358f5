"""Domain exceptions as OpenAI's error bodies and HTTP statuses (the HTTP twin of
services/common/serving.py's gRPC mapping: the messages are the same)."""

from __future__ import annotations

import email.message
import logging
import re

from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from services.common import errors
from services.common.limits import clip
from services.router.http.schemas import ErrorInfo, ErrorResponse

logger = logging.getLogger(__name__)


class BodyTooLarge(errors.InvalidRequest):
    """A request body over --max-message-bytes (HTTP 413)."""


class BodyTimeout(errors.InvalidRequest):
    """A request body that did not arrive in time (HTTP 408)."""


class ServerBusy(errors.PipelineUnavailable):
    """The router serves its limit of HTTP requests already (HTTP 503, Retry-After)."""


# (exception, HTTP status, OpenAI error type, code); the first match wins
_STATUSES: list[tuple[type[BaseException], int, str, str | None]] = [
    (errors.ModelNotFound, 404, "invalid_request_error", "model_not_found"),
    (BodyTooLarge, 413, "invalid_request_error", "request_too_large"),
    (BodyTimeout, 408, "invalid_request_error", "request_timeout"),
    (ServerBusy, 503, "service_unavailable_error", "server_busy"),
    (errors.InvalidRequest, 400, "invalid_request_error", None),
    (errors.ModelLoadError, 400, "invalid_request_error", None),  # e.g. no chat template
    (errors.Unauthenticated, 401, "authentication_error", "invalid_api_key"),
    (errors.PermissionDenied, 403, "permission_error", None),
    (errors.RequestExists, 409, "invalid_request_error", None),
    (errors.QueueFull, 429, "rate_limit_error", "queue_full"),
    (errors.PipelineUnavailable, 503, "service_unavailable_error", None),
    (errors.StateStoreError, 503, "service_unavailable_error", None),
    (errors.RequestFailed, 500, "server_error", None),
]


_NAMED_FIELD = re.compile(r"([a-z_][a-z0-9_]*)=")
"""The core's range errors start with the field they refuse: "temperature=-1 is out of ..."."""


def error_body(exc: BaseException) -> tuple[int, ErrorResponse]:
    """(HTTP status, OpenAI error body) of an exception; 500 for anything unexpected. A
    400 names the field it refuses in `param` where its message starts with `field=`."""
    for exc_type, status, kind, code in _STATUSES:
        if isinstance(exc, exc_type):
            message = str(exc)
            named = _NAMED_FIELD.match(message) if status == 400 else None
            param = named[1] if named else None
            info = ErrorInfo(message=message, type=kind, code=code, param=param)
            return status, ErrorResponse(error=info)
    message = f"internal error in the router: {type(exc).__name__}: {exc}"
    return 500, ErrorResponse(error=ErrorInfo(message=message, type="server_error"))


def error_response(exc: BaseException) -> JSONResponse:
    status, body = error_body(exc)
    if status == 500:
        logger.exception("HTTP request failed", exc_info=exc)
    headers = {"www-authenticate": "Bearer"} if status == 401 else None
    if isinstance(exc, ServerBusy):
        headers = {"retry-after": "1"}
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


def validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """(message naming every bad field, the first field's name) of a body that does not fit
    the schema."""
    parts, param = [], None
    for error in exc.errors():
        if error.get("type") == "json_invalid":  # loc is ("body", character offset)
            where = error.get("loc", ("body", "?"))[-1]
            reason = error.get("ctx", {}).get("error", "JSON decode error")
            return f"the request body is not valid JSON: {reason} at character {where}", None
        if error.get("type") == "invalid_unicode":  # names its field itself (schemas.py)
            return error.get("msg", "invalid Unicode"), error.get("ctx", {}).get("where")
        loc = [str(x) for x in error.get("loc", ()) if x != "body"]
        name = ".".join(loc) or "body"
        param = param or name
        parts.append(f"{name}: {error.get('msg', 'invalid')}")
    return "; ".join(parts) or "the request body is not valid", param


def is_json(content_type: str | None) -> bool:
    """Whether a Content-Type names JSON, as FastAPI decides whether to parse a body."""
    if not content_type:
        return False
    message = email.message.Message()
    message["content-type"] = content_type
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (
        subtype == "json" or subtype.endswith("+json")
    )


def _invalid(message: str, status: int, param: str | None = None) -> JSONResponse:
    body = ErrorResponse(
        error=ErrorInfo(message=message, type="invalid_request_error", param=param)
    )
    return JSONResponse(body.model_dump(), status_code=status)


async def on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    """400 naming the bad fields; 415 for a body not sent as JSON (`curl -d` without a
    Content-Type header sends a form), which FastAPI leaves unparsed."""
    content_type = request.headers.get("content-type")
    if exc.body is not None and not is_json(content_type):
        given = f"Content-Type {clip(content_type)}" if content_type else "no Content-Type"
        return _invalid(
            f"the request body must be JSON, sent with 'Content-Type: application/json' "
            f"(this request had {given})",
            415,
        )
    message, param = validation_message(exc)
    return _invalid(message, 400, param)


async def on_client_gone(request: Request, exc: Exception) -> Response:
    """A client that hung up before its answer: its request is aborted already, and nobody
    reads this response (499, nginx's "client closed request"). Not an error of the server:
    one debug line, not a traceback per hang-up."""
    logger.debug("%s %s: %s", request.method, request.url.path, exc)
    return Response(status_code=499)


async def on_conveyor_error(request: Request, exc: Exception) -> JSONResponse:
    return error_response(exc)


async def on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    """Starlette's own errors (unknown path, wrong method, unreadable body) in OpenAI's shape;
    FastAPI's "error parsing the body" says what was wrong with it where it can."""
    kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
    message, cause = str(exc.detail), exc.__cause__
    if isinstance(cause, UnicodeDecodeError):
        message = (
            f"the request body is not valid UTF-8 (byte {cause.start}): send JSON encoded in UTF-8"
        )
    elif isinstance(cause, RecursionError):
        message = "the request body's JSON nests too deeply to parse"
    body = ErrorResponse(error=ErrorInfo(message=message, type=kind))
    return JSONResponse(body.model_dump(), status_code=exc.status_code, headers=exc.headers)

"""The router's side of the scheduler: submit, resume after a broken stream, abort, health.

Every request of the router travels on one `Scheduler.Session` (services/router/session.py):
submits, resumes and aborts go out as commands, token deltas come back batched, many
requests per message. A request's stream that breaks with UNAVAILABLE (scheduler restart,
network: the session itself broke) is re-attached with a resume command from its offset, on
a new session, retried with backoff for up to `resume_timeout_s`. Offsets make it exact:
tokens before the first offset the client has not seen are dropped, so the client sees
neither a gap nor a duplicate.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.errors import (
    ConveyorError,
    InvalidRequest,
    PipelineUnavailable,
    QueueFull,
    RequestExists,
    RequestFailed,
    UnknownRequest,
)
from services.common.pb import FINISH_FROM_PB, logprobs_from_pb, sampling_to_pb
from services.common.proto.conveyor.v1 import scheduler_pb2, scheduler_pb2_grpc
from services.common.security import ClientSecurity
from services.router.output import SchedulerDelta
from services.router.request import PreparedRequest
from services.router.session import SchedulerSession, SessionStream

logger = logging.getLogger(__name__)

_MAX_BACKOFF_S = 2.0


class StreamBroken(Exception):
    """The Submit/Resume stream ended without a finished delta (internal: triggers resume)."""


def scheduler_error(exc: grpc.aio.AioRpcError) -> ConveyorError:
    """A domain exception, with an actionable message, for a scheduler status."""
    code, details = exc.code(), exc.details() or ""
    if code is grpc.StatusCode.INVALID_ARGUMENT:
        return InvalidRequest(details)
    if code is grpc.StatusCode.RESOURCE_EXHAUSTED:
        return QueueFull(
            f"{details} (the scheduler's queue is full: retry with backoff, "
            "or raise the scheduler's --max-waiting)"
        )
    if code is grpc.StatusCode.UNAVAILABLE:
        return PipelineUnavailable(
            f"the scheduler cannot serve now: {details} (retry when "
            "`conveyor health` reports SERVING)"
        )
    if code is grpc.StatusCode.ALREADY_EXISTS:
        return RequestExists(
            f"{details} (request ids must be unique; leave it empty to have one generated)"
        )
    if code is grpc.StatusCode.NOT_FOUND:
        return UnknownRequest(details)
    return RequestFailed(f"the scheduler answered {code.name}: {details}")


def delta_from_pb(msg: scheduler_pb2.TokenDelta, next_offset: int) -> SchedulerDelta:
    """A delta without the tokens before `next_offset` (already delivered)."""
    skip = max(0, next_offset - msg.offset)
    if msg.offset > next_offset:
        raise RequestFailed(f"the scheduler skipped tokens {next_offset}..{msg.offset - 1}")
    return SchedulerDelta(
        offset=msg.offset + skip,
        token_ids=list(msg.token_ids[skip:]),
        logprobs=[logprobs_from_pb(lp) for lp in msg.logprobs[skip:]],
        finish_reason=FINISH_FROM_PB.get(msg.finish_reason, "error"),
        num_prompt_tokens=msg.num_prompt_tokens,
        num_cached_tokens=msg.num_cached_tokens,
        error=msg.error,
        weight_version=msg.weight_version,
    )


class SchedulerClient:
    """One channel and one session to the scheduler, shared by every request of a router."""

    def __init__(
        self,
        address: str,
        resume_timeout_s: float = 60.0,
        security: ClientSecurity | None = None,
    ):
        self.address = address
        self.resume_timeout_s = resume_timeout_s
        self.security = security or ClientSecurity()
        """TLS to the scheduler and the internal token every call presents."""
        self._metadata = self.security.with_metadata(None)
        self._channel = self.security.channel(address)
        self._stub = scheduler_pb2_grpc.SchedulerStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._session: SchedulerSession | None = None
        self._closed = False

    def _current(self) -> SchedulerSession:
        """The open session, or a new one (the last one ended)."""
        if self._closed:
            raise PipelineUnavailable("the router is shutting down")
        if self._session is None or not self._session.is_open:
            self._session = SchedulerSession(self._stub, self._metadata)
        return self._session

    async def close(self) -> None:
        self._closed = True
        if self._session is not None:
            await self._session.close()
        await self._channel.close()

    async def is_serving(self, timeout_s: float = 1.0) -> bool:
        """True when the scheduler answers its health check with SERVING."""
        try:
            reply = await self._health.Check(
                health_pb2.HealthCheckRequest(), timeout=timeout_s, metadata=self._metadata
            )
        except grpc.aio.AioRpcError:
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    def abort(self, request_id: str, principal: str = "", owner_token: str = "") -> None:
        """Aborts a request (of `principal`, submitted with `owner_token`). Nothing answers:
        its streams end with finish reason abort, and a scheduler that never hears it (a
        broken session) aborts the request as an orphan."""
        if self._closed:
            return  # shutting down: the scheduler aborts it as an orphan
        msg = scheduler_pb2.AbortRequest(
            request_id=request_id, principal=principal, owner_token=owner_token
        )
        self._current().abort(msg)

    async def stream(
        self,
        req: PreparedRequest,
        metadata: tuple[tuple[str, str], ...] | None = None,
    ) -> AsyncIterator[SchedulerDelta]:
        """Submits `req` and yields its deltas until one carries a finish reason.
        `metadata` is the Submit's (the W3C traceparent when tracing)."""
        submit = scheduler_pb2.SessionRequest(
            submit=scheduler_pb2.SubmitRequest(
                request_id=req.request_id,
                prompt_token_ids=req.prompt_ids,
                sampling=sampling_to_pb(req.sampling),
                priority=req.priority,
                tenant=req.tenant,
                principal=req.principal,
                owner_token=req.owner_token,
            ),
            traceparent=dict(metadata or ()).get("traceparent", ""),
        )
        call = self._current().open(submit)
        pending = None  # a message the resume already read from `call`
        next_offset, has_output = 0, False
        try:
            while True:
                try:
                    while True:
                        msg = await call.read() if pending is None else pending
                        pending = None
                        if msg is grpc.aio.EOF:
                            raise StreamBroken("the stream ended before the request finished")
                        delta = delta_from_pb(msg, next_offset)
                        has_output = True
                        next_offset = delta.offset + len(delta.token_ids)
                        yield delta
                        if delta.finish_reason is not None:
                            return
                except (grpc.aio.AioRpcError, StreamBroken) as exc:
                    if isinstance(exc, grpc.aio.AioRpcError) and (
                        exc.code() is not grpc.StatusCode.UNAVAILABLE
                    ):
                        raise scheduler_error(exc) from exc
                    call.cancel()
                    call, pending = await self._resume(req, next_offset, exc, has_output)
        finally:
            call.cancel()

    async def _resume(
        self, req: PreparedRequest, offset: int, cause: Exception, has_output: bool
    ) -> tuple[SessionStream, scheduler_pb2.TokenDelta]:
        """(stream, its first message) of a resume the scheduler accepted; retries while it
        is unreachable, for up to resume_timeout_s. Only the request this Submit created is
        resumed (its owner token): a Submit refused while another request with its id runs
        finds nothing (NOT_FOUND), never the other request's tokens."""
        request_id = req.request_id
        deadline = time.monotonic() + self.resume_timeout_s
        delay = 0.1
        logger.info("stream of %s broke at offset %d; resuming", request_id, offset)
        resume = scheduler_pb2.ResumeRequest(
            request_id=request_id,
            from_offset=offset,
            principal=req.principal,
            owner_token=req.owner_token,
        )
        while True:
            call = self._current().open(scheduler_pb2.SessionRequest(resume=resume))
            try:
                return call, await call.read()
            except grpc.aio.AioRpcError as exc:
                call.cancel()
                if exc.code() is grpc.StatusCode.NOT_FOUND and not has_output:
                    # The scheduler never took the request: report why Submit failed.
                    if isinstance(cause, grpc.aio.AioRpcError):
                        raise scheduler_error(cause) from cause
                    raise scheduler_error(exc) from exc
                if exc.code() is not grpc.StatusCode.UNAVAILABLE:
                    raise scheduler_error(exc) from exc
            if time.monotonic() + delay > deadline:
                raise PipelineUnavailable(
                    f"lost the scheduler at {self.address} and could not resume request "
                    f"{request_id} within {self.resume_timeout_s:.0f} s; retry the request"
                )
            await asyncio.sleep(delay)
            delay = min(2 * delay, _MAX_BACKOFF_S)

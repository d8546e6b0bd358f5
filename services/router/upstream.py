"""The router's side of one scheduler: its channel, session, health and stats.

Every request of the router on one pipeline travels on one `Scheduler.Session`
(services/router/session.py): submits, resumes and aborts go out as commands, token deltas
come back batched, many requests per message. Streams, and their resumes after a break
(scheduler restart, network, a pipeline lost and adopted), are driven by the pool of every
pipeline (services/router/pool.py), which holds one `SchedulerClient` per scheduler.
"""

from __future__ import annotations

import logging

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
from services.common.pb import FINISH_FROM_PB, logprobs_from_pb
from services.common.proto.conveyor.v1 import scheduler_pb2, scheduler_pb2_grpc
from services.common.security import ClientSecurity
from services.router.output import SchedulerDelta
from services.router.session import SchedulerSession, SessionStream

logger = logging.getLogger(__name__)


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
    """A delta without the tokens before `next_offset` (already delivered). A message with
    neither tokens nor a finish reason (a scheduler letting go of an adopted request) sits
    at `next_offset`: its offset may count tokens that scheduler could not persist, and so
    never streamed; the new owner recomputes them."""
    offset = msg.offset
    if not msg.token_ids and FINISH_FROM_PB.get(msg.finish_reason, "error") is None:
        offset = next_offset
    skip = max(0, next_offset - offset)
    if offset > next_offset:
        raise RequestFailed(f"the scheduler skipped tokens {next_offset}..{offset - 1}")
    return SchedulerDelta(
        offset=offset + skip,
        token_ids=list(msg.token_ids[skip:]),
        logprobs=[logprobs_from_pb(lp) for lp in msg.logprobs[skip:]],
        finish_reason=FINISH_FROM_PB.get(msg.finish_reason, "error"),
        num_prompt_tokens=msg.num_prompt_tokens,
        num_cached_tokens=msg.num_cached_tokens,
        error=msg.error,
        weight_version=msg.weight_version,
    )


MAX_LATE_HEALTH_CHECKS = 3
"""Health checks in a row that may time out before the router takes a scheduler for down."""


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
        self._serving = False
        """The last health verdict (`is_serving`)."""
        self._num_late = 0
        """Health checks timed out in a row."""

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
        """True when the scheduler answers its health check with SERVING. A check that
        times out keeps the last answer until `MAX_LATE_HEALTH_CHECKS` time out in a row
        (a scheduler on a starved host answers late, and is alive); a refused connection
        or NOT_SERVING is believed at once."""
        try:
            reply = await self._health.Check(
                health_pb2.HealthCheckRequest(), timeout=timeout_s, metadata=self._metadata
            )
        except grpc.aio.AioRpcError as exc:
            is_late = exc.code() is grpc.StatusCode.DEADLINE_EXCEEDED
            self._num_late = self._num_late + 1 if is_late else 0
            if not is_late or self._num_late >= MAX_LATE_HEALTH_CHECKS:
                self._serving = False
            return self._serving
        self._num_late = 0
        self._serving = reply.status == health_pb2.HealthCheckResponse.SERVING
        return self._serving

    def open(self, command: scheduler_pb2.SessionRequest) -> SessionStream:
        """Sends a submit or resume on the session (a new one if the last ended)."""
        return self._current().open(command)

    def drop_session(self, details: str) -> None:
        """Ends the session to a scheduler found lost (see SchedulerSession.drop); the next
        command opens a new one."""
        if self._session is not None and self._session.is_open:
            self._session.drop(details)

    async def stats(self, timeout_s: float = 1.0) -> scheduler_pb2.SchedulerStats | None:
        """The scheduler's GetStats, or None when it does not answer."""
        try:
            return await self._stub.GetStats(
                scheduler_pb2.GetStatsRequest(), timeout=timeout_s, metadata=self._metadata
            )
        except grpc.aio.AioRpcError:
            return None

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

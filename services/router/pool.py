"""The router's pipelines: one `SchedulerClient` (channel + session) per scheduler, a routing
policy to pick one per request, and resumes that follow a request to the pipeline that owns
it (docs/scale-out.md).

Pipelines come from `--scheduler`/`--schedulers` (static addresses; each one's pipeline id
and block size are read once with GetStats) and, with `--redis-url`, from the schedulers'
announcements (address, health, queue, cached prefix hashes), refreshed every
`health_interval_s`.

A request's stream that breaks (its scheduler restarted or is gone) or ends naming another
owner (a Resume answered by a scheduler that does not run it; a pipeline that was adopted)
is resumed from the last offset delivered: at the owner when known and reachable, else at any
serving pipeline, whose answer names the owner. Offsets make it exact: no gap, no duplicate.
A resume that finds nothing live (the owner is lost and not adopted yet) is tried again with
backoff for up to `resume_timeout_s`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc

from services.common.errors import PipelineUnavailable
from services.common.pb import sampling_to_pb
from services.common.proto.conveyor.v1 import scheduler_pb2
from services.common.security import ClientSecurity
from services.router.output import SchedulerDelta
from services.router.request import PreparedRequest
from services.router.routing import PipelineView, Router, RoutingPolicy
from services.router.session import SchedulerAnswer
from services.router.upstream import (
    SchedulerClient,
    StreamBroken,
    delta_from_pb,
    scheduler_error,
)

logger = logging.getLogger(__name__)

_MAX_BACKOFF_S = 2.0
_DISCOVERY_RETRY_S = (1.0, 5.0)
"""Seconds between reads of the announcements while Redis refuses: first, most (doubling)."""
_TENANT_SALT = "tenant:{}"  # services/scheduler/request.py Request.cache_salt


@dataclass(slots=True)
class Pipeline:
    """One scheduler as this router reaches it."""

    client: SchedulerClient
    view: PipelineView
    pipeline_id: str | None = None
    """Its --pipeline-id once known ("" for a lone pipeline)."""
    is_static: bool = True
    """From --scheduler(s): polled for health; else from an announcement."""
    is_announced: bool = False
    """Its scheduler announces itself (in Redis, `discovery`)."""
    is_expired: bool = False
    """Its announcement expired (it announced before)."""
    lost: asyncio.Event = field(default_factory=asyncio.Event)
    """Set while it is lost: its announcement expired and it does not answer health (another
    pipeline adopts its requests; its streams are resumed there)."""


class SchedulerPool:
    """Every pipeline this router sends to; reads like one `SchedulerClient` to RouterCore."""

    def __init__(
        self,
        addresses: list[str],
        resume_timeout_s: float = 60.0,
        security: ClientSecurity | None = None,
        routing: RoutingPolicy | str = RoutingPolicy.PREFIX,
        load_weight: float = 0.5,
        discovery=None,
    ):
        """`discovery`: a callable returning the announcements (blocking: run in a thread),
        or None for static addresses only."""
        self.resume_timeout_s = resume_timeout_s
        self.security = security or ClientSecurity()
        self.router = Router(routing, load_weight)
        self.pipelines: dict[str, Pipeline] = {}
        """By scheduler address."""
        self._discovery = discovery
        self._discovery_delay_s = _DISCOVERY_RETRY_S[0]
        self._discovery_retry_at = 0.0
        """After a failed read: no other read before this time (time.monotonic)."""
        self._owners: dict[tuple[str, str], str] = {}
        """(principal, request id) -> address of the pipeline that runs it, while streaming
        and until its abort."""
        for address in addresses:
            self._add(address, is_static=True)

    @property
    def address(self) -> str:
        return ",".join(self.pipelines) or "(none discovered yet)"

    def _add(self, address: str, is_static: bool) -> Pipeline:
        pipeline = self.pipelines.get(address)
        if pipeline is None:
            client = SchedulerClient(address, self.resume_timeout_s, self.security)
            pipeline = Pipeline(client, PipelineView(address), is_static=is_static)
            self.pipelines[address] = pipeline
        return pipeline

    def by_id(self, pipeline_id: str) -> Pipeline | None:
        for pipeline in self.pipelines.values():
            if pipeline.pipeline_id == pipeline_id:
                return pipeline
        return None

    # ------------------------------------------------------------------ health, discovery
    async def is_serving(self, timeout_s: float = 1.0) -> bool:
        """Refreshes every pipeline's state; True when at least one serves."""
        await self.refresh(timeout_s)
        return any(p.view.serving for p in self.pipelines.values())

    async def refresh(self, timeout_s: float = 1.0) -> None:
        if self._discovery is not None and time.monotonic() >= self._discovery_retry_at:
            try:
                announcements = await asyncio.to_thread(self._discovery)
            except Exception as exc:  # noqa: BLE001 - Redis down: keep what is known
                delay_s = self._discovery_delay_s
                logger.warning(
                    "cannot read the pipelines' announcements: %s (retrying in %.0f s)",
                    exc,
                    delay_s,
                )
                self._discovery_retry_at = time.monotonic() + delay_s
                self._discovery_delay_s = min(2 * delay_s, _DISCOVERY_RETRY_S[1])
            else:
                self._discovery_delay_s = _DISCOVERY_RETRY_S[0]
                self._apply(announcements)
        static = [p for p in self.pipelines.values() if p.is_static]
        await asyncio.gather(*(self._poll(p, timeout_s) for p in static))
        for pipeline in self.pipelines.values():
            # Lost: announced once, its announcement expired, and (a listed one) its
            # health unanswered too; a live one announces again within a tick.
            if pipeline.is_announced and pipeline.is_expired and not pipeline.view.serving:
                if not pipeline.lost.is_set():
                    pipeline.lost.set()
                    pipeline.client.drop_session(
                        f"pipeline {pipeline.pipeline_id} is lost (its announcement expired)"
                    )
            else:
                pipeline.lost.clear()

    def _apply(self, announcements) -> None:
        seen = set()
        for ann in announcements:
            pipeline = self._add(ann.address, is_static=False)
            seen.add(ann.address)
            pipeline.pipeline_id = ann.pipeline_id
            pipeline.is_announced, pipeline.is_expired = True, False
            view = pipeline.view
            if not pipeline.is_static:
                view.serving = ann.serving
            view.announced(ann.num_waiting + ann.num_running, time.monotonic() - ann.age_s)
            view.block_size, view.cache_epoch = ann.block_size, ann.cache_epoch
            view.prefix_hashes = ann.prefix_hashes
        for address, pipeline in self.pipelines.items():
            if address in seen:
                continue
            pipeline.is_expired = True
            if not pipeline.is_static:
                pipeline.view.serving = False  # its announcement expired: lost

    async def _poll(self, pipeline: Pipeline, timeout_s: float) -> None:
        view = pipeline.view
        view.serving = await pipeline.client.is_serving(timeout_s)
        if view.serving and (pipeline.pipeline_id is None or not view.block_size):
            stats = await pipeline.client.stats(timeout_s)
            if stats is not None:
                pipeline.pipeline_id = stats.pipeline_id
                view.block_size = view.block_size or stats.block_size

    async def stats(self) -> list[scheduler_pb2.SchedulerStats]:
        """GetStats of every pipeline that answers (bench, tests)."""
        found = await asyncio.gather(*(p.client.stats(5.0) for p in self.pipelines.values()))
        return [s for s in found if s is not None]

    async def close(self) -> None:
        await asyncio.gather(*(p.client.close() for p in self.pipelines.values()))

    # ------------------------------------------------------------------ requests
    def abort(self, request_id: str, principal: str = "", owner_token: str = "") -> None:
        """Aborts a request at the pipeline that runs it (see SchedulerClient.abort)."""
        address = self._owners.pop((principal, request_id), None)
        pipeline = self.pipelines.get(address) if address else None
        targets = [pipeline] if pipeline else list(self.pipelines.values())
        for target in targets:
            target.client.abort(request_id, principal, owner_token)

    async def stream(
        self,
        req: PreparedRequest,
        metadata: tuple[tuple[str, str], ...] | None = None,
    ) -> AsyncIterator[SchedulerDelta]:
        """Submits `req` to the pipeline the policy picks and yields its deltas until one
        carries a finish reason, following the request wherever it runs."""
        salt = _TENANT_SALT.format(req.tenant or "default")
        view = self.router.choose([p.view for p in self.pipelines.values()], req.prompt_ids, salt)
        if view is None:  # the view may lag a pipeline that just came back: look again first
            await self.refresh()
            views = [p.view for p in self.pipelines.values()]
            view = self.router.choose(views, req.prompt_ids, salt)
        if view is None:
            raise PipelineUnavailable(
                f"no pipeline is serving (schedulers: {self.address}): retry when "
                "`conveyor health` reports SERVING"
            )
        pipeline = self.pipelines[view.key]
        key = (req.principal, req.request_id)
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
        call = pipeline.client.open(submit)
        target = _Target(req.request_id, req.principal, req.owner_token, submit=submit)
        relay = self._relay(pipeline, call, None, _Resumer(self, target), 0, False, key)
        async with contextlib.aclosing(relay) as deltas:
            async for delta in deltas:
                yield delta

    async def resume(
        self, request_id: str, principal: str, offset: int
    ) -> AsyncIterator[SchedulerDelta]:
        """The public Resume: the deltas of `principal`'s request from `offset` on, at the
        pipeline that owns it (whichever submission of the id, through whichever router),
        until one carries a finish reason. Raises UnknownRequest when no scheduler knows
        it (also another principal's: ids live in the principal's namespace)."""
        resumer = _Resumer(self, _Target(request_id, principal, "", any_submission=True))
        pipeline, call, pending = await resumer.resume(offset, None, has_output=True)
        key = (principal, request_id)
        relay = self._relay(pipeline, call, pending, resumer, offset, True, key)
        try:
            async with contextlib.aclosing(relay) as deltas:
                async for delta in deltas:
                    yield delta
        finally:
            # No abort follows a resume (it holds no owner token): forget the pipeline.
            self._owners.pop(key, None)

    async def _relay(
        self,
        pipeline: Pipeline,
        call,
        pending: scheduler_pb2.TokenDelta | None,
        resumer: _Resumer,
        next_offset: int,
        has_output: bool,
        key: tuple[str, str],
    ) -> AsyncIterator[SchedulerDelta]:
        """Yields the deltas of `call` from `next_offset` on until one carries a finish
        reason, resuming wherever the request runs when the stream breaks. `pending`: a
        message the resume already read from `call`."""
        self._owners[key] = pipeline.view.key
        pipeline.view.num_inflight += 1
        opened = time.monotonic()
        is_counted = True  # counted in `pipeline`'s open streams
        is_done = False
        try:
            while True:
                try:
                    while True:
                        msg = await _read(pipeline, call) if pending is None else pending
                        pending = None
                        if msg is grpc.aio.EOF:
                            raise StreamBroken("the stream ended before the request finished")
                        if msg.owner_pipeline_id:
                            resumer.owner_id = msg.owner_pipeline_id
                        else:
                            resumer.progressed()
                        delta = delta_from_pb(msg, next_offset)
                        has_output = True
                        next_offset = delta.offset + len(delta.token_ids)
                        yield delta
                        if delta.finish_reason is not None:
                            is_done = True
                            return
                except (grpc.aio.AioRpcError, StreamBroken) as exc:
                    if isinstance(exc, grpc.aio.AioRpcError) and (
                        exc.code() is not grpc.StatusCode.UNAVAILABLE
                    ):
                        raise scheduler_error(exc) from exc
                    call.cancel()
                    pipeline.view.stream_ended(opened, time.monotonic())
                    is_counted = False
                    resumer.failed = pipeline
                    pipeline, call, pending = await resumer.resume(next_offset, exc, has_output)
                    pipeline.view.num_inflight += 1
                    opened = time.monotonic()
                    is_counted = True
                    self._owners[key] = pipeline.view.key
        finally:
            call.cancel()
            if is_counted:
                pipeline.view.stream_ended(opened, time.monotonic())
            if is_done:
                self._owners.pop(key, None)


async def _read(pipeline: Pipeline, call):
    """`call.read()`, or StreamBroken once `pipeline` is lost. A scheduler that stalls
    without dying (a stopped process, a paused VM) never breaks its streams: they waited
    while another pipeline adopted their requests and, nobody resuming them there, aborted
    them as orphans. A pipeline that does not announce itself is never lost."""
    if not pipeline.is_announced:
        return await call.read()
    reading = asyncio.ensure_future(call.read())
    lost = asyncio.ensure_future(pipeline.lost.wait())
    try:
        await asyncio.wait({reading, lost}, return_when=asyncio.FIRST_COMPLETED)
        if reading.done():
            return reading.result()
    finally:
        for future in (reading, lost):
            future.cancel()
    raise StreamBroken(f"pipeline {pipeline.pipeline_id} is lost (its announcement expired)")


@dataclass(slots=True, frozen=True)
class _Target:
    """The request a resume asks for, as the scheduler knows it."""

    request_id: str
    principal: str
    owner_token: str
    """The submission's secret: only the router that submitted it knows it."""
    any_submission: bool = False
    """The public Resume: the principal's request of that id, whoever submitted it."""
    submit: scheduler_pb2.SessionRequest | None = None
    """The Submit that created it (None: the public Resume): sent again where no scheduler
    took it."""


class _Resumer:
    """Finds where a broken stream continues: the owner, or whoever can name it."""

    def __init__(self, pool: SchedulerPool, target: _Target):
        self.pool = pool
        self.target = target
        self.owner_id: str | None = None
        """The pipeline a scheduler last named as the request's owner."""
        self.failed: Pipeline | None = None
        self._stalled_since: float | None = None
        self._delay = 0.0

    def progressed(self) -> None:
        """A live message arrived: the next break starts a fresh resume."""
        self._stalled_since = None
        self._delay = 0.0

    def _candidates(self) -> list[Pipeline]:
        owner = self.pool.by_id(self.owner_id) if self.owner_id is not None else None
        others = [
            p for p in self.pool.pipelines.values() if p is not owner and p is not self.failed
        ]
        others.sort(key=lambda p: not p.view.serving)
        tail = [self.failed] if self.failed is not None and self.failed is not owner else []
        # A lost pipeline may be stopped, not dead: a resume there would wait for good.
        return [p for p in ([owner] if owner else []) + others + tail if not p.lost.is_set()]

    async def _submit_again(
        self, pipeline: Pipeline, cause: Exception | None
    ) -> tuple[Pipeline, object, scheduler_pb2.TokenDelta] | None:
        """The Submit sent again to `pipeline` (nothing of it was persisted, so nothing runs
        twice); None when that pipeline is unavailable too. A refusal (e.g. the id is in
        use: ALREADY_EXISTS) is the Submit's answer to the client."""
        logger.warning(
            "no scheduler took request %s (%s): submitting it again to pipeline %s",
            self.target.request_id,
            cause,
            pipeline.pipeline_id or pipeline.view.key,
        )
        command = scheduler_pb2.SessionRequest()
        command.CopyFrom(self.target.submit)  # its own stream id: the first may be unsent yet
        call = pipeline.client.open(command)
        try:
            return pipeline, call, await call.read()
        except grpc.aio.AioRpcError as exc:
            call.cancel()
            if exc.code() is not grpc.StatusCode.UNAVAILABLE:
                raise scheduler_error(exc) from exc
            return None

    async def resume(
        self, offset: int, cause: Exception | None, has_output: bool
    ) -> tuple[Pipeline, object, scheduler_pb2.TokenDelta]:
        """(pipeline, stream, its first message) of a resume a scheduler accepted. Only the
        request this Submit created is resumed (its owner token): a Submit refused while
        another request with its id runs finds nothing (NOT_FOUND), never the other's
        tokens. A Submit no scheduler took (none persisted it: the one it went to died or
        stopped before reading it) is sent again, to the candidate that did not find it."""
        req = self.target
        now = time.monotonic()
        if self._stalled_since is None:
            self._stalled_since = now
            logger.info("stream of %s broke at offset %d; resuming", req.request_id, offset)
        resume = scheduler_pb2.ResumeRequest(
            request_id=req.request_id,
            from_offset=offset,
            principal=req.principal,
            owner_token=req.owner_token,
            any_submission=req.any_submission,
        )
        while True:
            if time.monotonic() - self._stalled_since > self.pool.resume_timeout_s:
                raise PipelineUnavailable(
                    f"lost the scheduler(s) at {self.pool.address} and could not resume "
                    f"request {req.request_id} within {self.pool.resume_timeout_s:.0f} s; "
                    "retry the request"
                )
            if self._delay:
                await asyncio.sleep(self._delay)
            self._delay = min(max(2 * self._delay, 0.1), _MAX_BACKOFF_S)
            for pipeline in self._candidates():
                call = pipeline.client.open(scheduler_pb2.SessionRequest(resume=resume))
                try:
                    return pipeline, call, await call.read()
                except grpc.aio.AioRpcError as exc:
                    call.cancel()
                    if exc.code() is grpc.StatusCode.NOT_FOUND and not has_output:
                        if isinstance(cause, SchedulerAnswer):  # it refused the Submit
                            raise scheduler_error(cause) from cause
                        if req.submit is None:
                            raise scheduler_error(exc) from exc
                        submitted = await self._submit_again(pipeline, cause)
                        if submitted is not None:
                            return submitted
                    elif exc.code() is not grpc.StatusCode.UNAVAILABLE:
                        raise scheduler_error(exc) from exc

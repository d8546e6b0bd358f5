"""`Scheduler.Session`: every request of one router on one bidirectional stream.

A Submit stream per request costs both ends a gRPC message, and asyncio wake-ups, per
request and token: at ~300 us of CPU per message and process that capped the control plane
at ~3k tok/s whatever the pipeline could do. A session carries the router's commands in and,
out, one message holding the deltas of every request that moved since the last one: as the
scheduling loop publishes a step's deltas (synchronously, all at once), a session collects
them and sends them in one write. While a write waits for the router (HTTP/2 flow control),
the next steps' deltas gather behind it: a slow router gets fewer, larger messages, and
backpressure reaches the scheduler as it did with a stream per request (it never blocks
the loop; deltas wait in memory).

Commands act as the RPCs of the same name on `SchedulerService` (ownership checks, request
keys in the principal's namespace, tombstones, resume from the store), and what those RPCs
would end with as a status arrives as an update with that status. When the session ends
(the router went away or broke the stream), its requests lose their listener and become
orphans: aborted after the orphan timeout unless a Resume (on a new session) attaches.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from services.common.errors import ConveyorError, InvalidRequest
from services.common.pb import FINISH_TO_PB, logprobs_to_pb, sampling_from_pb
from services.common.proto.conveyor.v1 import scheduler_pb2
from services.common.serving import message_for, status_for
from services.scheduler.ownership import request_key
from services.scheduler.service import SchedulerService
from services.scheduler.state import TokenDelta

logger = logging.getLogger(__name__)

MAX_RESPONSE_BYTES = 1 << 20
"""A response holds updates up to about this size, well below any receive limit (4 MiB by
default); more wait for the next message."""


def delta_to_pb(
    delta: TokenDelta, msg: scheduler_pb2.TokenDelta | None = None
) -> scheduler_pb2.TokenDelta:
    """The delta's message; with `msg` (an empty one, e.g. a new update's `delta`) filled in
    place. Only the fields that differ from their defaults are set: a message built with
    every field named cost ~2x as much, at one delta per request and step."""
    msg = scheduler_pb2.TokenDelta() if msg is None else msg
    msg.request_id = delta.request_id
    msg.offset = delta.offset
    msg.token_ids.extend(delta.token_ids)
    if delta.finish_reason is not None:
        msg.finish_reason = FINISH_TO_PB[delta.finish_reason]
    if delta.num_cached_tokens:
        msg.num_cached_tokens = delta.num_cached_tokens
    if delta.num_prompt_tokens:
        msg.num_prompt_tokens = delta.num_prompt_tokens
    if delta.weight_version:
        msg.weight_version = delta.weight_version
    if delta.num_spec_steps:
        msg.num_spec_steps = delta.num_spec_steps
        msg.num_spec_draft_tokens = delta.num_spec_draft_tokens
        msg.num_spec_accepted_tokens = delta.num_spec_accepted_tokens
    if delta.error:
        msg.error = delta.error
    if delta.owner_pipeline_id is not None:
        msg.owner_pipeline_id = delta.owner_pipeline_id
    if delta.logprobs:
        msg.logprobs.extend(logprobs_to_pb(lp) for lp in delta.logprobs if lp is not None)
    return msg


class _Stream:
    """One submit's or resume's stream: registered with the service as the request's
    subscriber (anything with `put_nowait(delta)`)."""

    __slots__ = ("session", "stream_id", "key", "num_prompt_tokens", "task")

    def __init__(
        self, session: RouterSession, stream_id: int, key: str, num_prompt_tokens: int = 0
    ):
        self.session = session
        self.stream_id = stream_id
        self.key = key
        self.num_prompt_tokens = num_prompt_tokens
        """Sent with the first delta (Submit's first message carries it), then 0."""
        self.task: asyncio.Task | None = None
        """A resume's reader of `SchedulerService.resume`; None for a submit."""

    def put_nowait(self, delta: TokenDelta) -> None:
        self.session.push(self, delta)


class RouterSession:
    """One router's session: reads its commands, writes batched updates."""

    def __init__(self, service: SchedulerService, traceparents: bool):
        self.service = service
        self._traceparents = traceparents
        self._streams: dict[int, _Stream] = {}
        self._outbox: list[tuple[_Stream | None, TokenDelta | None, scheduler_pb2.SessionUpdate]]
        self._outbox = []
        self._wake = asyncio.Event()

    async def run(self, commands: AsyncIterator) -> AsyncIterator[scheduler_pb2.SessionResponse]:
        """Yields responses until the router ends its side (or the reader fails: raised)."""
        reader = asyncio.create_task(self._read(commands), name="session-reader")
        try:
            while True:
                if not self._outbox:
                    self._wake.clear()
                    waker = asyncio.ensure_future(self._wake.wait())
                    await asyncio.wait({reader, waker}, return_when=asyncio.FIRST_COMPLETED)
                    waker.cancel()
                if self._outbox:
                    yield self._drain()
                elif reader.done():
                    reader.result()  # raises what ended the reader
                    return
        finally:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader
            self._close()

    # ------------------------------------------------------------------ commands
    async def _read(self, commands: AsyncIterator) -> None:
        async for command in commands:
            which = command.WhichOneof("command")
            if which is None:
                raise InvalidRequest("a SessionRequest names no command: set one")
            if which == "abort":
                msg = command.abort
                self.service.abort(request_key(msg.principal, msg.request_id), msg.owner_token)
            elif which == "cancel":
                self._cancel(command.stream_id)
            else:
                self._check_new_stream(command.stream_id)
                if which == "submit":
                    self._submit(command)
                else:
                    self._resume(command.stream_id, command.resume)

    def _check_new_stream(self, stream_id: int) -> None:
        if stream_id == 0 or stream_id in self._streams:
            raise InvalidRequest(
                f"stream_id {stream_id} is {'0' if stream_id == 0 else 'already open'}: "
                "a submit or resume needs a new nonzero stream_id"
            )

    def _submit(self, command: scheduler_pb2.SessionRequest) -> None:
        msg = command.submit
        key = request_key(msg.principal, msg.request_id)
        stream = _Stream(self, command.stream_id, key, len(msg.prompt_token_ids))
        self._streams[stream.stream_id] = stream
        try:
            self.service.submit(
                key,
                list(msg.prompt_token_ids),
                sampling_from_pb(msg.sampling),
                priority=msg.priority,
                tenant=msg.tenant,
                weight=msg.weight,
                traceparent=(command.traceparent or None) if self._traceparents else None,
                owner_token=msg.owner_token,
                subscriber=stream,
            )
        except Exception as exc:  # noqa: BLE001 - the stream ends with the status Submit's would
            self._fail(stream, exc)

    def _resume(self, stream_id: int, msg: scheduler_pb2.ResumeRequest) -> None:
        stream = _Stream(self, stream_id, request_key(msg.principal, msg.request_id))
        self._streams[stream_id] = stream
        stream.task = asyncio.create_task(self._follow(stream, msg), name="session-resume")

    async def _follow(self, stream: _Stream, msg: scheduler_pb2.ResumeRequest) -> None:
        """A resume: what `SchedulerService.resume` yields, then its end."""
        try:
            owner_token = None if msg.any_submission else msg.owner_token
            async for delta in self.service.resume(stream.key, msg.from_offset, owner_token):
                self.push(stream, delta)
                if delta.finish_reason is not None:
                    return
                if delta.owner_pipeline_id is not None:
                    break  # another pipeline runs it: ended below, resumed there
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - the stream ends with the status Resume's would
            self._fail(stream, exc)
            return
        if self._streams.pop(stream.stream_id, None) is not None:
            self._enqueue(
                None, None, scheduler_pb2.SessionUpdate(stream_id=stream.stream_id, ended=True)
            )

    def _cancel(self, stream_id: int) -> None:
        stream = self._streams.pop(stream_id, None)
        if stream is None:
            return  # finished already (its last update crossed the cancel)
        if stream.task is not None:
            stream.task.cancel()  # resume's own cleanup unsubscribes
        else:
            self.service.unsubscribe(stream.key, stream)

    def _fail(self, stream: _Stream, exc: Exception) -> None:
        if not isinstance(exc, ConveyorError):
            logger.error("session stream %d failed", stream.stream_id, exc_info=exc)
        self._streams.pop(stream.stream_id, None)
        update = scheduler_pb2.SessionUpdate(
            stream_id=stream.stream_id,
            status_code=status_for(exc).value[0],
            status_message=message_for(exc, "scheduler"),
        )
        self._enqueue(None, None, update)

    def _close(self) -> None:
        """The session ended: its requests have one listener fewer (orphans if none left)."""
        for stream in self._streams.values():
            if stream.task is not None:
                stream.task.cancel()
            else:
                self.service.unsubscribe(stream.key, stream)
        self._streams.clear()

    # ------------------------------------------------------------------ updates
    def push(self, stream: _Stream, delta: TokenDelta) -> None:
        """A delta for `stream` (from the scheduling loop or a resume)."""
        if delta.finish_reason is not None:  # its last: the stream id may be used again
            self._streams.pop(stream.stream_id, None)
        self._enqueue(stream, delta, None)
        # Adopted by another pipeline: the submit's stream ends here, to be resumed there
        # (a resume's own reader ends its stream).
        is_moved = delta.owner_pipeline_id is not None and stream.task is None
        if is_moved and self._streams.pop(stream.stream_id, None) is not None:
            update = scheduler_pb2.SessionUpdate(stream_id=stream.stream_id, ended=True)
            self._enqueue(None, None, update)

    def _enqueue(self, stream, delta, update) -> None:
        self._outbox.append((stream, delta, update))
        self._wake.set()

    def _drain(self) -> scheduler_pb2.SessionResponse:
        """One response with the outbox's updates from the oldest on (about
        MAX_RESPONSE_BYTES at most; the rest stays for the next)."""
        response = scheduler_pb2.SessionResponse()
        updates = response.updates
        size, taken = 0, 0
        for stream, delta, update in self._outbox:
            if update is None:  # built in place: appending a built message copies it
                update = updates.add(stream_id=stream.stream_id)
                delta_to_pb(delta, update.delta)
                if stream.num_prompt_tokens:
                    update.delta.num_prompt_tokens = stream.num_prompt_tokens
            else:
                updates.append(update)
            size += updates[-1].ByteSize()
            if taken and size > MAX_RESPONSE_BYTES:
                del updates[-1]  # goes in the next response
                break
            if stream is not None:
                stream.num_prompt_tokens = 0  # sent once, with the stream's first delta
            taken += 1
        del self._outbox[:taken]
        return response

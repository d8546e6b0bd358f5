"""The router's end of `Scheduler.Session`: every request of this router to one scheduler
on one stream.

`SchedulerSession` owns the bidirectional call: commands go out through one queue (the call
writes them in order), and one reader task hands each update to the `SessionStream` it
names. A stream reads like the Submit or Resume call it replaces: `read()` returns the next
TokenDelta, `grpc.aio.EOF` when the scheduler ended it without a finish reason, or raises
the `grpc.aio.AioRpcError` that call would have ended with, so the resume logic of
pool.py is the same for both. When the session itself ends (the scheduler restarted,
the network broke) every open stream gets its status and the next command opens a new
session.
"""

from __future__ import annotations

import asyncio
import itertools
import logging

import grpc

from services.common.proto.conveyor.v1 import scheduler_pb2, scheduler_pb2_grpc

logger = logging.getLogger(__name__)

_CODES = {code.value[0]: code for code in grpc.StatusCode}


class SchedulerAnswer(grpc.aio.AioRpcError):
    """A status the scheduler ended a stream with: it read the command and answered, unlike
    a session that broke (then the command may never have reached it)."""


def _status(code: grpc.StatusCode, details: str, cls=grpc.aio.AioRpcError) -> grpc.aio.AioRpcError:
    return cls(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


class SessionStream:
    """One submit's or resume's updates, read like the call it replaces."""

    __slots__ = ("session", "stream_id", "_inbox", "is_open")

    def __init__(self, session: SchedulerSession, stream_id: int):
        self.session = session
        self.stream_id = stream_id
        self._inbox: asyncio.Queue = asyncio.Queue()
        self.is_open = True
        """Until its last update (a finish reason, an end or a status) arrived."""

    async def read(self):
        """The next TokenDelta, or grpc.aio.EOF; raises the stream's AioRpcError."""
        item = await self._inbox.get()
        if isinstance(item, BaseException):
            raise item
        return item

    def put(self, item) -> None:
        self._inbox.put_nowait(item)

    def cancel(self) -> None:
        """Stop listening (the scheduler stops sending; the request runs on)."""
        self.session.cancel(self)


class SchedulerSession:
    """One `Session` call and the streams open on it."""

    def __init__(self, stub: scheduler_pb2_grpc.SchedulerStub, metadata):
        self._commands: asyncio.Queue = asyncio.Queue()
        self._streams: dict[int, SessionStream] = {}
        self._ids = itertools.count(1)
        self._call = stub.Session(self._send(), metadata=metadata)
        self._reader = asyncio.create_task(self._read(), name="scheduler-session")
        self.is_open = True
        self._dropped: grpc.aio.AioRpcError | None = None

    def open(self, command: scheduler_pb2.SessionRequest) -> SessionStream:
        """Sends a submit or resume on a new stream."""
        stream = SessionStream(self, next(self._ids))
        command.stream_id = stream.stream_id
        if not self.is_open:  # ended between the caller's check and now
            stream.put(_status(grpc.StatusCode.UNAVAILABLE, "the scheduler session ended"))
            return stream
        self._streams[stream.stream_id] = stream
        self._commands.put_nowait(command)
        return stream

    def abort(self, msg: scheduler_pb2.AbortRequest) -> None:
        self._commands.put_nowait(scheduler_pb2.SessionRequest(abort=msg))

    def cancel(self, stream: SessionStream) -> None:
        if self._streams.pop(stream.stream_id, None) is not None and self.is_open:
            self._commands.put_nowait(
                scheduler_pb2.SessionRequest(stream_id=stream.stream_id, cancel=True)
            )
        stream.is_open = False

    async def close(self) -> None:
        self._call.cancel()
        await asyncio.gather(self._reader, return_exceptions=True)

    def drop(self, details: str) -> None:
        """Ends the session now, its scheduler lost: what the scheduler has not read of it
        is never read (a stopped scheduler would read it on waking, and run a Submit the
        router has since sent elsewhere), and every open stream breaks with UNAVAILABLE
        `details`, to be resumed elsewhere."""
        self.is_open = False
        self._dropped = _status(grpc.StatusCode.UNAVAILABLE, details)
        self._call.cancel()

    async def _send(self):
        """The commands, until None: a session that ended stops gRPC's task that sends them
        (left waiting here, it was destroyed pending, logged at ERROR, when the session was
        dropped)."""
        while (command := await self._commands.get()) is not None:
            yield command

    async def _read(self) -> None:
        ended: BaseException | object = grpc.aio.EOF
        try:
            async for response in self._call:
                for update in response.updates:
                    self._deliver(update)
            logger.warning("the scheduler ended the session; streams will resume")
        except grpc.aio.AioRpcError as exc:
            if exc.code() is not grpc.StatusCode.CANCELLED:
                logger.warning("scheduler session broke: %s %s", exc.code().name, exc.details())
            ended = exc
        except asyncio.CancelledError:
            ended = self._dropped or _status(
                grpc.StatusCode.CANCELLED, "the router closed the session"
            )
            raise
        finally:
            self.is_open = False
            self._commands.put_nowait(None)
            for stream in self._streams.values():
                stream.is_open = False
                stream.put(ended)
            self._streams.clear()

    def _deliver(self, update: scheduler_pb2.SessionUpdate) -> None:
        stream = self._streams.get(update.stream_id)
        if stream is None:  # cancelled: updates that crossed the cancel
            return
        if update.status_code:
            code = _CODES.get(update.status_code, grpc.StatusCode.UNKNOWN)
            item = _status(code, update.status_message, SchedulerAnswer)
        elif update.ended:
            item = grpc.aio.EOF
        else:
            item = update.delta
            if not item.finish_reason:
                stream.put(item)
                return
        del self._streams[update.stream_id]
        stream.is_open = False
        stream.put(item)

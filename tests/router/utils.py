"""Router test harness: a fake scheduler on loopback and a real `conveyor router` process.

The fake scheduler is a tiny grpc.aio Scheduler servicer (in a thread of the test process)
that streams a scripted answer; tests set `fake.mode` / `fake.answer` before a request and
read back what the router did (`submits`, `aborts`, `resumes`).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from services.common.proto.conveyor.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from tests.conftest import free_port

ROOT = Path(__file__).resolve().parents[2]
ANSWER = "Hello, world! The quick brown fox jumps over the lazy dog. Héllo 日本語 🙂 done."


@dataclass
class FakeScheduler(scheduler_pb2_grpc.SchedulerServicer):
    """Streams `answer_ids` (capped at max_tokens), `ids_per_delta` at a time.

    mode: "ok" | "endless" (tokens until aborted) | "break" (UNAVAILABLE after
    `break_after` tokens, once per request; Resume continues) | "lose-submit" (the session
    breaks as a request's first Submit arrives, which it never takes) | a grpc.StatusCode
    to answer Submit with (message `error_message`).
    """

    answer_ids: list[int]
    mode: object = "ok"
    ids_per_delta: int = 1
    break_after: int = 3
    error_message: str = "fake scheduler error"
    delay_s: float = 0.0
    weight_version: int = 0
    submits: list[scheduler_pb2.SubmitRequest] = field(default_factory=list)
    aborts: list[str] = field(default_factory=list)
    resumes: list[tuple[str, int]] = field(default_factory=list)
    _known: dict[str, scheduler_pb2.SubmitRequest] = field(default_factory=dict)
    _broken: set[str] = field(default_factory=set)
    _lost: set[str] = field(default_factory=set)

    def reset(self, **kwargs) -> None:
        self.mode, self.ids_per_delta, self.delay_s, self.weight_version = "ok", 1, 0.0, 0
        self.submits.clear(), self.aborts.clear(), self.resumes.clear()
        for key, value in kwargs.items():
            setattr(self, key, value)

    def _ids(self, req: scheduler_pb2.SubmitRequest) -> tuple[list[int], int]:
        max_tokens = req.sampling.max_tokens
        if self.mode == "endless":
            return [self.answer_ids[i % len(self.answer_ids)] for i in range(100_000)], 0
        ids = self.answer_ids[:max_tokens]
        reason = (
            common_pb2.FINISH_REASON_LENGTH
            if len(ids) == max_tokens
            else common_pb2.FINISH_REASON_STOP
        )
        return ids, reason

    async def _deltas(self, req, start: int, context):
        ids, reason = self._ids(req)
        for offset in range(start, len(ids), self.ids_per_delta):
            if req.request_id in self.aborts:
                yield scheduler_pb2.TokenDelta(
                    request_id=req.request_id,
                    offset=offset,
                    finish_reason=common_pb2.FINISH_REASON_ABORT,
                )
                return
            if (
                self.mode == "break"
                and offset >= self.break_after
                and req.request_id not in self._broken
            ):
                self._broken.add(req.request_id)
                await context.abort(grpc.StatusCode.UNAVAILABLE, "scheduler restarting")
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
            chunk = ids[offset : offset + self.ids_per_delta]
            last = offset + len(chunk) >= len(ids)
            yield scheduler_pb2.TokenDelta(
                request_id=req.request_id,
                offset=offset,
                token_ids=chunk,
                finish_reason=reason if last else common_pb2.FINISH_REASON_UNSPECIFIED,
                num_prompt_tokens=len(req.prompt_token_ids) if offset == 0 else 0,
                weight_version=self.weight_version,
            )

    async def Submit(self, request, context):
        self.submits.append(request)
        if isinstance(self.mode, grpc.StatusCode):
            await context.abort(self.mode, self.error_message)
        if request.request_id in self._known:
            await context.abort(
                grpc.StatusCode.ALREADY_EXISTS, f"request {request.request_id} exists"
            )
        self._known[request.request_id] = request
        async for delta in self._deltas(request, 0, context):
            yield delta

    async def Resume(self, request, context):
        self.resumes.append((request.request_id, request.from_offset))
        if request.request_id not in self._known:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"{request.request_id} unknown")
        # Re-send one already delivered token: the router must drop the duplicate.
        start = max(0, request.from_offset - 1)
        async for delta in self._deltas(self._known[request.request_id], start, context):
            yield delta

    async def Abort(self, request, context):
        self.aborts.append(request.request_id)
        return scheduler_pb2.AbortResponse(aborted=True)

    async def GetStats(self, request, context):
        return scheduler_pb2.SchedulerStats(serving=True)

    async def Session(self, request_iterator, context):
        """Each command runs as the RPC of its name, on a stream of the session."""
        updates: asyncio.Queue = asyncio.Queue()
        streams: dict[int, asyncio.Task] = {}
        stream_context = _StreamContext(context)

        async def run(stream_id: int, deltas) -> None:
            try:
                async for delta in deltas:
                    updates.put_nowait(
                        scheduler_pb2.SessionUpdate(stream_id=stream_id, delta=delta)
                    )
                    if delta.finish_reason:
                        return
                    await asyncio.sleep(0)  # let aborts and cancels in (endless mode)
                updates.put_nowait(scheduler_pb2.SessionUpdate(stream_id=stream_id, ended=True))
            except _StreamAbort as exc:
                update = scheduler_pb2.SessionUpdate(
                    stream_id=stream_id, status_code=exc.code.value[0], status_message=exc.details
                )
                updates.put_nowait(update)

        async def read() -> None:
            async for command in request_iterator:
                which, stream_id = command.WhichOneof("command"), command.stream_id
                if which == "abort":
                    await self.Abort(command.abort, stream_context)
                elif which == "cancel":
                    streams.pop(stream_id).cancel()
                elif (
                    which == "submit"
                    and self.mode == "lose-submit"
                    and command.submit.request_id not in self._lost
                ):
                    self._lost.add(command.submit.request_id)
                    updates.put_nowait(None)  # the session breaks, the Submit never taken
                    return
                else:
                    rpc = self.Submit if which == "submit" else self.Resume
                    deltas = rpc(getattr(command, which), stream_context)
                    streams[stream_id] = asyncio.create_task(run(stream_id, deltas))

        reader = asyncio.create_task(read())
        try:
            while True:
                batch = [await updates.get()]
                if batch[0] is None:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "the scheduler died")
                while not updates.empty():
                    batch.append(updates.get_nowait())
                yield scheduler_pb2.SessionResponse(updates=batch)
        finally:
            for task in (reader, *streams.values()):
                task.cancel()


class _StreamAbort(Exception):
    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(details)
        self.code, self.details = code, details


class _StreamContext:
    """What Submit and Resume see of a session stream: the session's metadata, and an abort
    that ends only this stream (with the status the router reads as that call's)."""

    def __init__(self, context):
        self._context = context

    def invocation_metadata(self):
        return self._context.invocation_metadata()

    async def abort(self, code: grpc.StatusCode, details: str):
        raise _StreamAbort(code, details)


class FakeSchedulerServer:
    """Runs a FakeScheduler (and a SERVING health service) in a background event loop."""

    def __init__(self, fake: FakeScheduler):
        self.fake = fake
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self.health: health.aio.HealthServicer | None = None

    def start(self) -> FakeSchedulerServer:
        self._thread.start()
        self._call(self._start())
        return self

    def _call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=30)

    async def _start(self) -> None:
        self.server = grpc.aio.server()
        scheduler_pb2_grpc.add_SchedulerServicer_to_server(self.fake, self.server)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        await self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        self.server.add_insecure_port(self.address)
        await self.server.start()

    def set_serving(self, is_serving: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if is_serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        self._call(self.health.set("", status))

    def stop(self) -> None:
        self._call(self.server.stop(grace=0))
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)


def wait_until(predicate, timeout_s: float = 20.0, what: str = "condition") -> None:
    """Polls `predicate` (a correctness wait, not a timing assertion)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


class RouterProcess:
    """`python -m services.cli router ...` on a free port; waits until it is SERVING (over TLS
    with `security`'s CA when the flags turn TLS on). `log`: a file for its output (else the
    test's own)."""

    def __init__(
        self,
        scheduler_address: str,
        model_dir: Path,
        *extra: str,
        security=None,
        log: Path | None = None,
    ):
        self.security = security
        self.log = log
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        argv = [
            sys.executable,
            "-m",
            "services.cli",
            "router",
            "--scheduler",
            scheduler_address,
            "--model",
            str(model_dir),
            "--port",
            str(self.port),
            "--resume-timeout",
            "10",
            *extra,
        ]
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        out = log.open("w") if log is not None else None
        self.proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=out, stderr=out)
        if out is not None:
            out.close()  # the child holds its own descriptor

    def wait_serving(self, timeout_s: float = 60.0) -> RouterProcess:
        from services.launcher import wait_serving

        wait_serving(self.address, timeout_s, self.proc, security=self.security)
        return self

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

"""`Pipeline`: the scheduler's side of the stage workers — connect, describe, stream plans.

One `Run` stream per stage per session. A plan is serialized once and the same bytes are
written to every stage, by one writer task per stage: the scheduling loop only queues them
(a gRPC write costs ~0.1 ms of CPU awaited in turn, so eight stages written one after the
other held the loop ~1 ms per plan; concurrent writers cost less and never hold it). The
queues stay short: at most the steps in flight. The last stage's reports carry the sampled tokens; any stage may
report an error, and a stream that breaks means a worker is gone: the session is over.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import grpc

from services.common.errors import PipelineUnavailable
from services.common.proto.conveyor.v1 import worker_pb2, worker_pb2_grpc
from services.common.security import ClientSecurity
from services.scheduler.config import PipelineInfo

logger = logging.getLogger(__name__)

_RUN_METHOD = "/conveyor.v1.StageWorker/Run"


@dataclass(slots=True)
class StageReport:
    """A step's report from the last stage (sampled tokens)."""

    stage: int
    report: worker_pb2.StepReport


@dataclass(slots=True)
class StageFailure:
    """A stage failed or its stream ended: the session is over."""

    message: str
    step_id: int | None = None
    """The step a stage failed on (None: the stage is gone)."""


class PipelineBroken(Exception):
    """A stage failed or disappeared; the message says which and why."""

    def __init__(self, message: str, request_ids: list[str] | None = None):
        super().__init__(message)
        self.request_ids = request_ids or []
        """The requests of the step a stage failed on (none when a stage is gone)."""


class Pipeline:
    """Channels to every stage and the Run streams of the current session."""

    def __init__(self, addresses: list[str], security: ClientSecurity | None = None):
        self.addresses = addresses
        self.security = security or ClientSecurity()
        """TLS to the workers and the internal token every call presents."""
        self._metadata = self.security.with_metadata(None)
        self._channels = [
            self.security.channel(a, options=[("grpc.max_send_message_length", 64 << 20)])
            for a in addresses
        ]
        self._stubs = [worker_pb2_grpc.StageWorkerStub(c) for c in self._channels]
        # Plans go out pre-serialized: identity serializer, so one encode serves every stage.
        self._run = [
            c.stream_stream(
                _RUN_METHOD,
                request_serializer=None,
                response_deserializer=worker_pb2.StepReport.FromString,
            )
            for c in self._channels
        ]
        self._calls: list[grpc.aio.StreamStreamCall] = []
        self.reports: asyncio.Queue[StageReport | StageFailure] = asyncio.Queue()
        """The last stage's reports, and a failure of any stage."""
        self._readers: list[asyncio.Task] = []
        self._outboxes: list[asyncio.Queue[bytes]] = []
        self._writers: list[asyncio.Task] = []
        self.epoch = 0

    @property
    def is_open(self) -> bool:
        return bool(self._calls)

    async def describe(self, timeout_s: float = 2.0) -> PipelineInfo:
        """Asks every stage; raises PipelineUnavailable naming the stages not ready."""
        replies = await asyncio.gather(
            *[
                s.Describe(worker_pb2.DescribeRequest(), timeout=timeout_s, metadata=self._metadata)
                for s in self._stubs
            ],
            return_exceptions=True,
        )
        problems = []
        for address, reply in zip(self.addresses, replies, strict=True):
            if isinstance(reply, Exception):
                code = (
                    reply.code().name if isinstance(reply, grpc.RpcError) else type(reply).__name__
                )
                problems.append(f"{address} unreachable ({code})")
            elif not reply.ready:
                problems.append(f"{address} still loading")
        if problems:
            raise PipelineUnavailable("pipeline not whole: " + "; ".join(problems))
        return self._check(list(replies))

    def _check(self, replies: list[worker_pb2.DescribeResponse]) -> PipelineInfo:
        num_stages = len(self.addresses)
        stages = sorted(r.stage for r in replies)
        if stages != list(range(num_stages)) or any(r.num_stages != num_stages for r in replies):
            raise PipelineUnavailable(
                f"--workers lists {num_stages} addresses but the workers report stages "
                f"{[r.stage for r in replies]} of {[r.num_stages for r in replies]}: list one "
                "worker per stage, in stage order"
            )
        for index, reply in enumerate(replies):
            if reply.stage != index:
                raise PipelineUnavailable(
                    f"worker {self.addresses[index]} is stage {reply.stage}, expected {index}: "
                    "list --workers in stage order"
                )
        if len({r.block_size for r in replies}) != 1:
            raise PipelineUnavailable(
                f"stages disagree on block size: {[r.block_size for r in replies]}"
            )
        last = replies[-1]
        return PipelineInfo(
            num_stages=num_stages,
            num_blocks=min(r.num_kv_blocks for r in replies),
            block_size=last.block_size,
            max_model_len=min(r.max_model_len for r in replies),
            vocab_size=last.vocab_size,
            model_name=last.model_name,
            eos_token_ids=list(last.eos_token_ids),
            device="cpu" if any(r.device in ("", "cpu") for r in replies) else last.device,
        )

    async def wait_ready(self, timeout_s: float | None = None) -> PipelineInfo:
        """Polls Describe until every stage is ready."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        last_error = None
        while deadline is None or time.monotonic() < deadline:
            try:
                return await self.describe()
            except PipelineUnavailable as exc:
                if str(exc) != last_error:
                    logger.info("%s", exc)
                    last_error = str(exc)
                await asyncio.sleep(0.5)
        raise PipelineUnavailable(last_error or "pipeline not ready")

    async def open(self) -> None:
        """Starts a session: one Run stream per stage, all with one fresh epoch."""
        await self.close()
        self.epoch = time.time_ns()
        metadata = self.security.with_metadata((("conveyor-epoch", str(self.epoch)),))
        self.reports = asyncio.Queue()
        self._calls = [run(metadata=metadata) for run in self._run]
        last = len(self._calls) - 1
        self._readers = [
            asyncio.create_task(self._read(stage, call, stage == last))
            for stage, call in enumerate(self._calls)
        ]
        self._outboxes = [asyncio.Queue() for _ in self._calls]
        self._writers = [
            asyncio.create_task(self._write(stage, call, outbox))
            for stage, (call, outbox) in enumerate(zip(self._calls, self._outboxes, strict=True))
        ]

    async def _read(self, stage: int, call, is_last: bool) -> None:
        try:
            async for report in call:
                if report.error:
                    self.reports.put_nowait(StageFailure(report.error, report.step_id))
                elif is_last:
                    self.reports.put_nowait(StageReport(stage, report))
            self.reports.put_nowait(
                StageFailure(f"stage {stage} ({self.addresses[stage]}) ended its stream")
            )
        except asyncio.CancelledError:
            raise
        except grpc.RpcError as exc:
            self.reports.put_nowait(
                StageFailure(f"stage {stage} ({self.addresses[stage]}) is gone: {exc.code().name}")
            )

    async def _write(self, stage: int, call, outbox: asyncio.Queue[bytes]) -> None:
        """Sends `stage` its plans in order; a failed write ends the session."""
        try:
            while True:
                await call.write(await outbox.get())
        except asyncio.CancelledError:
            raise
        except (grpc.RpcError, asyncio.InvalidStateError) as exc:
            self.reports.put_nowait(
                StageFailure(
                    f"could not send a plan to stage {stage} ({self.addresses[stage]}): {exc}"
                )
            )

    async def send(self, plan_bytes: bytes) -> None:
        """Queues one serialized StepPlan for every stage (its writer sends them in order; a
        write that fails puts a StageFailure on `reports`)."""
        for outbox in self._outboxes:
            outbox.put_nowait(plan_bytes)

    async def close(self) -> None:
        for task in (*self._readers, *self._writers):
            task.cancel()
        for call in self._calls:
            call.cancel()
        self._readers, self._writers, self._outboxes, self._calls = [], [], [], []

    async def timelines(self, include_steps: bool = False, reset: bool = False):
        """Every stage's Timeline (stage order); raises grpc errors for a stage that is gone."""
        request = worker_pb2.GetTimelineRequest(include_steps=include_steps, reset=reset)
        return await asyncio.gather(
            *[s.GetTimeline(request, timeout=10, metadata=self._metadata) for s in self._stubs]
        )

    async def shutdown(self) -> None:
        await self.close()
        for channel in self._channels:
            await channel.close()

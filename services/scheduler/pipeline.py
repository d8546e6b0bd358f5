"""`Pipeline`: the scheduler's side of the stage workers — connect, describe, stream plans.

One `Run` stream per worker per session: with T tensor-parallel ranks per stage, `--workers`
lists stages x ranks (stage-major) and every rank gets every plan (docs/tensor-parallel.md
says why the scheduler streams to all ranks rather than through a stage's rank 0). A plan is
serialized once and the same bytes are written to every worker, by one writer task per
worker: the scheduling loop only queues them (a gRPC write costs ~0.1 ms of CPU awaited in
turn, so eight stages written one after the other held the loop ~1 ms per plan; concurrent
writers cost less and never hold it). The queues stay short: at most the steps in flight;
a writer that finds several plans queued sends them as one message (`following`), so a
busy scheduler pays one write for several plans.
The last stage's rank 0 reports the sampled tokens; stage 0's rank 0 the plans it waited for
(async mode); any worker may report an error, and a stream that breaks means a worker is
gone: the session (the whole pipeline) is over.
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
from services.common.step import SESSION_ACCEPTED
from services.scheduler.config import PipelineInfo

logger = logging.getLogger(__name__)

_RUN_METHOD = "/conveyor.v1.StageWorker/Run"
SESSION_ACCEPT_TIMEOUT_S = 30.0
"""How long a new session waits for every stage to take it, i.e. for the stages to form the
pipeline (a stage still winding down the previous session takes it within moments; one busy
with another scheduler's refuses after the worker's SESSION_WAIT_S)."""


@dataclass(slots=True)
class StageReport:
    """A step's report from the last stage (sampled tokens)."""

    stage: int
    report: worker_pb2.StepReport


@dataclass(slots=True)
class PlanWait:
    """Stage 0 waited for a step's plan (async mode; the scheduler's window grows on it)."""

    step_id: int
    wait_ns: int


_MAX_PLAN_WAIT_NS = 60 * 10**9
"""A longer wait reported is read as this (the window needs no more to decide)."""


def plan_wait_of(report: worker_pb2.StepReport) -> int:
    """The report's plan wait, bounded (a stage's nonsense cannot push the window beyond
    its own limit anyway)."""
    return min(max(0, report.plan_wait_ns), _MAX_PLAN_WAIT_NS)


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


_MAX_JOINED = 64
"""At most this many plans in one message (they are small: ~1 KB at 32 requests)."""


def join_plans(first: bytes, outbox: asyncio.Queue[bytes]) -> bytes:
    """One serialized StepPlan: `first` with the plans queued behind it as its `following`.

    Appending a length-delimited field to a serialized message is how protobuf encodes a
    repeated field, so the plans are not parsed or encoded again."""
    parts = [first]
    while not outbox.empty() and len(parts) < _MAX_JOINED:
        plan_bytes = outbox.get_nowait()
        parts += (_FOLLOWING_TAG, _varint(len(plan_bytes)), plan_bytes)
    return b"".join(parts)


_FOLLOWING_TAG = bytes([worker_pb2.StepPlan.FOLLOWING_FIELD_NUMBER << 3 | 2])  # length-delimited


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


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
        self.reports: asyncio.Queue[StageReport | PlanWait | StageFailure] = asyncio.Queue()
        """The last stage's reports, stage 0's plan waits and a failure of any stage."""
        self._readers: list[asyncio.Task] = []
        self._outboxes: list[asyncio.Queue[bytes]] = []
        self._writers: list[asyncio.Task] = []
        self.epoch = 0
        self.tp_size = 1
        """Tensor-parallel ranks per stage, as the workers report them (Describe)."""
        self.reads_plan_waits = True
        """Whether stage 0's plan waits reach `reports`: the adaptive lead reads them, a
        fixed window (--max-inflight) has no use for them."""

    @property
    def is_open(self) -> bool:
        return bool(self._calls)

    @property
    def stubs(self) -> list[worker_pb2_grpc.StageWorkerStub]:
        """One stub per stage, stage order (for calls beside the Run streams)."""
        return self._stubs

    @property
    def metadata(self):
        """The credentials every call to a stage presents."""
        return self._metadata

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
        tp_sizes = {r.tensor_parallel_size or 1 for r in replies}
        if len(tp_sizes) != 1:
            raise PipelineUnavailable(
                f"workers disagree on tensor_parallel_size: "
                f"{[r.tensor_parallel_size or 1 for r in replies]}"
            )
        tp_size = tp_sizes.pop()
        num_stages = len(self.addresses) // tp_size
        if len(self.addresses) % tp_size or any(r.num_stages != num_stages for r in replies):
            raise PipelineUnavailable(
                f"--workers lists {len(self.addresses)} addresses but the workers report "
                f"tensor_parallel_size={tp_size} and stages {[r.num_stages for r in replies]}: "
                "list stages x ranks workers, stage-major (stage 0 rank 0, stage 0 rank 1, ...)"
            )
        for index, reply in enumerate(replies):
            expected = divmod(index, tp_size)
            if (reply.stage, reply.tp_rank) != expected:
                raise PipelineUnavailable(
                    f"worker {self.addresses[index]} is stage {reply.stage} tp rank "
                    f"{reply.tp_rank}, expected stage {expected[0]} tp rank {expected[1]}: list "
                    "--workers stage-major (stage 0 rank 0, stage 0 rank 1, ...)"
                )
        self.tp_size = tp_size
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
            weight_versions=[r.weight_version for r in replies],
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
        """Starts a session: one Run stream per stage, all with one fresh epoch. Returns once
        every stage has taken it (the stages formed the pipeline); raises PipelineUnavailable
        naming a stage that refused it (another scheduler's session holds that stage, or it
        could not join the pipeline) or the stages that did not answer in time."""
        await self.close()
        self.epoch = time.time_ns()
        metadata = self.security.with_metadata((("conveyor-epoch", str(self.epoch)),))
        self.reports = asyncio.Queue()
        self._calls = [run(metadata=metadata) for run in self._run]
        accepted: set[int] = set()
        every_stage = asyncio.gather(
            *(self._accepted(i, call, accepted) for i, call in enumerate(self._calls))
        )
        try:
            await asyncio.wait_for(every_stage, SESSION_ACCEPT_TIMEOUT_S)
        except BaseException as exc:
            if every_stage.done() and not every_stage.cancelled():
                every_stage.exception()  # seen (a shutdown cancels the calls and this task)
            waiting = [self._name(i) for i in range(len(self._calls)) if i not in accepted]
            await self.close()
            if isinstance(exc, TimeoutError):
                raise PipelineUnavailable(
                    f"{', '.join(waiting)} did not join the pipeline within "
                    f"{SESSION_ACCEPT_TIMEOUT_S:.0f} s: every stage must reach stage 0's "
                    "--dist-addr and the other stages' gloo ports (their logs say more), and "
                    "answer (not stopped)"
                ) from None
            raise
        reporter = len(self._calls) - self.tp_size  # the last stage's tp rank 0
        self._readers = [
            asyncio.create_task(
                self._read(index, call, index == reporter, index == 0 and self.reads_plan_waits)
            )
            for index, call in enumerate(self._calls)
        ]
        self._outboxes = [asyncio.Queue() for _ in self._calls]
        self._writers = [
            asyncio.create_task(self._write(index, call, outbox))
            for index, (call, outbox) in enumerate(zip(self._calls, self._outboxes, strict=True))
        ]

    async def _accepted(self, index: int, call, accepted: set[int]) -> None:
        """Returns once worker `index` took the session (its Run's initial metadata: the
        worker sends it once the stages formed the pipeline), adding `index` to `accepted`."""
        if SESSION_ACCEPTED in (await call.initial_metadata() or ()):
            accepted.add(index)
            return
        code, details = await call.code(), await call.details()
        raise PipelineUnavailable(
            f"{self._name(index)} refused the session: {code.name} ({details})"
        )

    def _name(self, index: int) -> str:
        stage, rank = divmod(index, self.tp_size)
        where = f"stage {stage}" if self.tp_size == 1 else f"stage {stage} tp rank {rank}"
        return f"{where} ({self.addresses[index]})"

    async def _read(self, index: int, call, reports_tokens: bool, reports_waits: bool) -> None:
        stage = index // self.tp_size
        try:
            async for report in call:
                if report.error:
                    self.reports.put_nowait(StageFailure(report.error, report.step_id))
                elif reports_tokens:
                    self.reports.put_nowait(StageReport(stage, report))
                elif reports_waits and report.plan_wait_ns > 0:
                    self.reports.put_nowait(PlanWait(report.step_id, plan_wait_of(report)))
            self.reports.put_nowait(StageFailure(f"{self._name(index)} ended its stream"))
        except asyncio.CancelledError:
            raise
        except grpc.RpcError as exc:
            details = f" ({exc.details()})" if exc.details() else ""
            self.reports.put_nowait(
                StageFailure(f"{self._name(index)} is gone: {exc.code().name}{details}")
            )

    async def _write(self, index: int, call, outbox: asyncio.Queue[bytes]) -> None:
        """Sends worker `index` its plans in order, the ones queued by the time a write starts
        in one message; a failed write ends the session."""
        try:
            while True:
                plan_bytes = await outbox.get()
                if not outbox.empty():
                    plan_bytes = join_plans(plan_bytes, outbox)
                await call.write(plan_bytes)
        except asyncio.CancelledError:
            raise
        except (grpc.RpcError, asyncio.InvalidStateError) as exc:
            self.reports.put_nowait(
                StageFailure(f"could not send a plan to {self._name(index)}: {exc}")
            )

    async def send(self, plan_bytes: bytes) -> None:
        """Queues one serialized StepPlan for every worker (its writer sends them in order; a
        write that fails puts a StageFailure on `reports`)."""
        for outbox in self._outboxes:
            outbox.put_nowait(plan_bytes)

    async def close(self) -> None:
        for task in (*self._readers, *self._writers):
            task.cancel()
        for call in self._calls:
            call.cancel()
        self._readers, self._writers, self._outboxes, self._calls = [], [], [], []

    @property
    def num_stages(self) -> int:
        return len(self.addresses) // self.tp_size

    async def timelines(
        self,
        include_steps: bool = False,
        reset: bool = False,
        return_exceptions: bool = False,
        timeout_s: float = 10.0,
    ):
        """Every stage's Timeline (stage order; a stage's tp rank 0 speaks for it, its peers
        run in lockstep); raises grpc errors for a stage that is gone or does not answer
        within `timeout_s`, or with `return_exceptions` puts the error in that stage's place."""
        request = worker_pb2.GetTimelineRequest(include_steps=include_steps, reset=reset)
        return await asyncio.gather(
            *[
                s.GetTimeline(request, timeout=timeout_s, metadata=self._metadata)
                for s in self._stubs[:: self.tp_size]
            ],
            return_exceptions=return_exceptions,
        )

    async def shutdown(self) -> None:
        await self.close()
        for channel in self._channels:
            await channel.close()

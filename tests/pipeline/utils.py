"""A whole pipeline in one process: the real scheduler service driving real stage engines.

    SchedulerService ──plan bytes──▶ LocalPipeline ──StepPlan──▶ StageEngine 0 … P-1
          ▲        (scheduler core,      (stands in for the Run     │ hidden: LocalLink queues
          │         real Redis store)     streams of every worker)  ▼ tokens: last → stage 0
          └───────────── StepReport (last stage, or any stage's error) ◀──┘

Only the wire is replaced: plans and reports still go through the protobuf conversions of
the gRPC path (`plan_to_pb` → `plan_from_pb`, `outcome_to_pb` → `result_from_report`), each
stage runs its own `StageRunner` on its own compute thread, and request state goes to Redis.
`LocalHub` logs the tokens the last stage forwards to stage 0 (async mode), and the
pipeline logs every plan and every report, so tests can see which path each token took.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import redis
import torch

from services.common.pb import plan_from_pb
from services.common.proto.conveyor.v1 import worker_pb2
from services.common.sampling import SamplingParams
from services.common.step import StepPlan, TokenLogprobs
from services.scheduler.config import PipelineInfo, SchedulerConfig
from services.scheduler.pipeline import PlanWait, StageFailure, StageReport
from services.scheduler.service import SchedulerService
from services.scheduler.state import TokenDelta
from services.scheduler.store import RedisStateStore
from services.worker.engine import StageEngine, StepOutcome
from services.worker.server import outcome_to_pb
from services.worker.transport import Transport
from tests.worker.utils import make_runners

RECV_TIMEOUT_S = 60.0
"""A receive that waits this long fails the stage (and the test) instead of hanging it."""

_REDIS_DB = 7  # a database of the session's private Redis that no other test area uses


class LocalHub:
    """The in-memory wire of one pipeline: one FIFO per (session, channel), and a log of
    the forwarded tokens.

    Channels: ("hidden", i) carries activations into stage i; ("tokens", 0) carries the last
    stage's sampled tokens to stage 0 (async mode).
    """

    def __init__(self) -> None:
        self._queues: dict[tuple[int, str, int], queue.Queue] = {}
        self._closed: set[int] = set()
        self._lock = threading.Lock()
        self.tokens_sent: list[list[int]] = []
        """Every token message the last stage sent to stage 0, in order."""
        self.tokens_received: list[list[int]] = []
        """Every token message stage 0 received, in order."""
        self.most_posted: collections.Counter = collections.Counter()
        """Per kind, the most receives a link had posted and not yet taken at once."""

    def channel(self, epoch: int, kind: str, dst: int) -> queue.Queue:
        with self._lock:
            channel = self._queues.get((epoch, kind, dst))
            if channel is None:
                channel = self._queues[(epoch, kind, dst)] = queue.Queue()
                if epoch in self._closed:
                    channel.put(None)
            return channel

    def close(self, epoch: int) -> None:
        """Ends a session: its waiting and later receives fail at once, as a receive from
        a closed socket does (so a stage stuck on a failed peer lets go)."""
        with self._lock:
            self._closed.add(epoch)
            for (session, _, _), channel in self._queues.items():
                if session == epoch:
                    channel.put(None)


class LocalLink:
    """A `Link` over `LocalHub` queues; receivers check each message against the shape the
    plan told them to expect, as a real receive buffer would."""

    def __init__(self, hub: LocalHub, epoch: int, stage: int, num_stages: int) -> None:
        self.hub, self.epoch = hub, epoch
        self.stage, self.num_stages = stage, num_stages
        self.expected: dict[str, collections.deque] = {
            "hidden": collections.deque(),
            "tokens": collections.deque(),
        }
        """Receives posted ahead (`expect_*`), oldest first."""

    def send_hidden(self, hidden: torch.Tensor) -> None:
        self.hub.channel(self.epoch, "hidden", self.stage + 1).put(hidden.detach().clone())

    def recv_hidden(self, num_tokens: int, hidden_size: int, dtype: torch.dtype) -> torch.Tensor:
        self._check_expected("hidden", (num_tokens, hidden_size), dtype)
        hidden = self._get("hidden", self.stage - 1)
        if hidden.shape != (num_tokens, hidden_size) or hidden.dtype != dtype:
            raise ValueError(
                f"stage {self.stage} expected hidden [{num_tokens}, {hidden_size}] {dtype}, "
                f"got {list(hidden.shape)} {hidden.dtype}"
            )
        return hidden

    def expect_hidden(self, num_tokens: int, hidden_size: int, dtype: torch.dtype) -> None:
        """The hub's queues hold a message until it is taken: only the shape is noted, and
        checked when a receive takes it, as `PipelineLink`'s posted buffers are."""
        self._expect("hidden", (num_tokens, hidden_size), dtype)

    def expect_tokens(self, num_tokens: int) -> None:
        self._expect("tokens", (num_tokens,), torch.int64)

    def _expect(self, kind: str, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        self.expected[kind].append((shape, dtype))
        most = self.hub.most_posted
        most[kind] = max(most[kind], len(self.expected[kind]))

    def _check_expected(self, kind: str, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        if self.expected[kind]:
            posted = self.expected[kind].popleft()
            if posted != (shape, dtype):
                raise RuntimeError(
                    f"stage {self.stage}: {kind} posted as {posted}, taken as {shape}"
                )

    def send_tokens(self, token_ids: torch.Tensor) -> None:
        tokens = token_ids.to(torch.int64).clone()
        self.hub.tokens_sent.append(tokens.tolist())
        self.hub.channel(self.epoch, "tokens", 0).put(tokens)

    def recv_tokens(self, num_tokens: int) -> torch.Tensor:
        self._check_expected("tokens", (num_tokens,), torch.int64)
        tokens = self._get("tokens", self.num_stages - 1)
        if tokens.shape != (num_tokens,):
            raise ValueError(f"stage 0 expected {num_tokens} tokens, got {tokens.tolist()}")
        self.hub.tokens_received.append(tokens.tolist())
        return tokens

    def _get(self, kind: str, src: int) -> torch.Tensor:
        dst = 0 if kind == "tokens" else self.stage
        try:
            message = self.hub.channel(self.epoch, kind, dst).get(timeout=RECV_TIMEOUT_S)
        except queue.Empty:
            raise TimeoutError(
                f"stage {self.stage}: no {kind} from stage {src} in {RECV_TIMEOUT_S:.0f} s"
            ) from None
        if message is None:
            raise ConnectionError(f"stage {self.stage}: session {self.epoch} was closed")
        return message


class LocalTransport:
    """A `Transport` whose sessions are `LocalLink`s on one hub."""

    def __init__(self, hub: LocalHub, stage: int, num_stages: int) -> None:
        self.hub, self.stage, self.num_stages = hub, stage, num_stages

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1

    def connect(self, epoch: int = 0) -> LocalLink:
        return LocalLink(self.hub, epoch, self.stage, self.num_stages)


class LocalPipeline:
    """Stands in for `services.scheduler.pipeline.Pipeline`: each session starts every
    engine, as each worker's Run stream does, and records what went through."""

    def __init__(self, engines: list[StageEngine], hub: LocalHub, max_model_len: int) -> None:
        self.engines, self.hub = engines, hub
        self.addresses = [f"in-process stage {i}" for i in range(len(engines))]
        self.max_model_len = max_model_len
        self.reports: asyncio.Queue = asyncio.Queue()
        self.epoch = 0
        self._live_epoch: int | None = None
        self.plans: list[StepPlan] = []
        """Every plan sent, as the stages decoded it."""
        self.results: list[worker_pb2.StepReport] = []
        """Every report of the last stage (the sampled tokens of each step)."""
        self.errors: list[str] = []
        self.failed = asyncio.Event()
        """Set at the first stage error: the service would re-queue and retry forever, and
        a test waiting for tokens would hang instead of failing."""
        self.num_sessions = 0
        self.reads_plan_waits = True
        self.plan_waits: list[tuple[int, int]] = []
        """(step, ns) of every plan wait stage 0 reported (async plans that came late)."""
        self.events: list[tuple[str, int]] = []
        """("plan", step) as plans are sent and ("report", step) as reports arrive."""

    @property
    def is_open(self) -> bool:
        return self.num_sessions > 0

    async def wait_ready(self, timeout_s: float | None = None) -> PipelineInfo:
        runners = [engine.runner for engine in self.engines]
        last = runners[-1]
        return PipelineInfo(
            num_stages=len(runners),
            num_blocks=min(r.kv_cache.num_blocks for r in runners),
            block_size=last.kv_cache.block_size,
            max_model_len=self.max_model_len,
            vocab_size=last.model.config.vocab_size,
            model_name="tiny",
            eos_token_ids=list(last.model.config.eos_token_ids),
        )

    async def open(self) -> None:
        await self.close()
        self.epoch += 1
        self.num_sessions += 1
        self._live_epoch = self.epoch
        self.reports = reports = asyncio.Queue()
        loop = asyncio.get_running_loop()
        for engine in self.engines:
            engine.start(self._on_outcome(loop, reports, engine.stage, self.epoch), self.epoch)

    def _on_outcome(self, loop, reports: asyncio.Queue, stage: int, epoch: int):
        is_last = stage == len(self.engines) - 1

        def on_outcome(outcome: StepOutcome) -> None:  # on the stage's compute thread
            if epoch != self._live_epoch:
                return  # a closed session: its Run stream is gone, nobody reads this
            if outcome.error:
                self.errors.append(outcome.error)
                loop.call_soon_threadsafe(
                    reports.put_nowait, StageFailure(outcome.error, outcome.step_id)
                )
                loop.call_soon_threadsafe(self.failed.set)
            elif is_last:
                report = outcome_to_pb(outcome, stage)
                self.results.append(report)
                self.events.append(("report", report.step_id))
                loop.call_soon_threadsafe(reports.put_nowait, StageReport(stage, report))
            elif stage == 0 and outcome.plan_wait_ns:  # as a worker's Run stream reports it
                self.plan_waits.append((outcome.step_id, outcome.plan_wait_ns))
                if self.reads_plan_waits:
                    wait = PlanWait(outcome.step_id, outcome.plan_wait_ns)
                    loop.call_soon_threadsafe(reports.put_nowait, wait)

        return on_outcome

    async def send(self, plan_bytes: bytes) -> None:
        msg = worker_pb2.StepPlan.FromString(plan_bytes)
        self.plans.append(plan_from_pb(msg))
        self.events.append(("plan", msg.step_id))
        for engine in self.engines:  # each worker decodes its own copy
            engine.submit(plan_from_pb(msg), msg.tokens_from_last_stage)

    async def close(self) -> None:
        self._live_epoch = None
        self.hub.close(self.epoch)
        for engine in self.engines:
            await asyncio.to_thread(engine.stop)

    async def shutdown(self) -> None:
        await self.close()


@dataclass
class Outcome:
    """What a client of one request saw: its tokens, logprobs and finish reason."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    finish_reason: str | None = None
    last_delta: TokenDelta | None = field(default=None, compare=False)
    """The last delta received (its cumulative per-request counts)."""


class InProcessStack:
    """Scheduler service + engines of `model_dir` split into `num_stages`, over Redis.

    Use as `async with InProcessStack(...) as stack:`; leaving stops every compute thread.
    """

    _ids = itertools.count()

    def __init__(
        self,
        model_dir: Path,
        num_stages: int,
        scheduling: str,
        redis_url: str,
        num_blocks: int = 64,
        block_size: int = 16,
        max_model_len: int = 256,
        runners: list | None = None,
        wrap_transport: Callable[[LocalTransport, object], Transport] | None = None,
        **options,
    ) -> None:
        """`runners` replaces the tiny model's runners (e.g. simulated stages), and
        `wrap_transport(transport, runner)` each stage's in-memory transport."""
        url = redis_url.rsplit("/", 1)[0] + f"/{_REDIS_DB}"
        redis.Redis.from_url(url).flushdb()  # no request of another test is recovered
        self.redis_url = url
        self.store = RedisStateStore(url)
        self.hub = LocalHub()
        self.runners = runners or make_runners(model_dir, num_stages, block_size, num_blocks)
        transports = [LocalTransport(self.hub, stage, num_stages) for stage in range(num_stages)]
        if wrap_transport is not None:
            transports = [
                wrap_transport(t, r) for t, r in zip(transports, self.runners, strict=True)
            ]
        engines = [
            StageEngine(runner, transport)
            for runner, transport in zip(self.runners, transports, strict=True)
        ]
        self.pipeline = LocalPipeline(engines, self.hub, max_model_len)
        self.service = SchedulerService(
            SchedulerConfig(scheduling=scheduling, **options), self.pipeline, self.store
        )

    async def __aenter__(self) -> InProcessStack:
        await self.service.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.service.stop()
        self.store.close()

    def submit(self, prompt: list[int], sampling: SamplingParams, request_id: str | None = None):
        """Queues a request; returns (request id, its delta queue)."""
        request_id = request_id or f"req-{next(self._ids)}"
        return request_id, self.service.submit(request_id, prompt, sampling)

    async def generate(
        self,
        prompts: list[list[int]],
        sampling: list[SamplingParams],
        request_ids: list[str] | None = None,
    ) -> list[Outcome]:
        """Submits every prompt at once (one after the other, before the loop plans) and
        returns what each client received."""
        request_ids = request_ids or [None] * len(prompts)
        queues = [
            self.submit(p, s, i)[1] for p, s, i in zip(prompts, sampling, request_ids, strict=True)
        ]
        return list(await asyncio.gather(*(self.collect(q) for q in queues)))

    async def collect(
        self, deltas: asyncio.Queue, outcome: Outcome | None = None, num_tokens: int | None = None
    ) -> Outcome:
        """Reads a request's deltas until it finishes (or has `num_tokens`); each delta must
        start where the last ended. Raises AssertionError as soon as a stage fails."""
        outcome = outcome or Outcome()
        while outcome.finish_reason is None and (
            num_tokens is None or len(outcome.token_ids) < num_tokens
        ):
            delta = await self._next(deltas)
            assert delta.offset == len(outcome.token_ids), "a delta skips or repeats tokens"
            outcome.token_ids.extend(delta.token_ids)
            outcome.logprobs.extend(delta.logprobs or [None] * len(delta.token_ids))
            outcome.finish_reason = delta.finish_reason
            outcome.last_delta = delta
        return outcome

    async def _next(self, deltas: asyncio.Queue):
        if not deltas.empty():
            return deltas.get_nowait()
        getter = asyncio.ensure_future(deltas.get())
        failed = asyncio.ensure_future(self.pipeline.failed.wait())
        await asyncio.wait({getter, failed}, return_when=asyncio.FIRST_COMPLETED)
        failed.cancel()
        if not getter.done():
            getter.cancel()
            raise AssertionError(f"the pipeline broke: {self.pipeline.errors}")
        return getter.result()

    @property
    def num_free_blocks(self) -> int:
        return self.service.scheduler.block_manager.num_free_blocks

    @property
    def num_blocks(self) -> int:
        return self.service.scheduler.config.num_blocks

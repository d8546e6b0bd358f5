"""`SchedulerService`: drives the scheduler core over a live pipeline (no gRPC servicer here).

The loop, on one asyncio task:

    dispatch: while fewer than K steps are in flight, plan a step and send it to every stage
    wait:     for the last stage's report, a new request or an abort
    process:  append tokens (one Redis round trip), stream deltas to subscribers

In async mode K = 2P: step s+P of a micro-batch is planned and sent before step s has
reported, so stage 0 finds its next plan waiting and takes the input tokens straight from
the last stage. In sync mode K = P and a request waits for its token to come back.
A stage that fails or disappears ends the session: every running request goes back to the
queue, to be recomputed once every stage answers Describe again.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from dataclasses import dataclass

from services.common.errors import ConfigError, PipelineUnavailable, StateStoreError, UnknownRequest
from services.common.pb import plan_to_pb, result_from_report
from services.common.sampling import SamplingParams
from services.scheduler.config import SchedulerConfig
from services.scheduler.pipeline import Pipeline, PipelineBroken, PipelineInfo
from services.scheduler.request import Request
from services.scheduler.scheduler import Scheduler
from services.scheduler.state import TokenDelta

logger = logging.getLogger(__name__)


DEFAULT_BATCHED_TOKENS = {"cpu": 512, "cuda": 2048}
"""Token budget of a step when --max-num-batched-tokens is not given, by the stages' device.
On the 2-core CPU, 512 instead of 2048 cut the burst's mean TTFT from 5.6 s to 4.0 s at the
same output throughput (`conveyor bench`, 64 x 128/128, 2 stages)."""


def default_batched_tokens(device: str, chunked_prefill: bool, max_model_len: int) -> int:
    """--max-num-batched-tokens when not given: by device, and a whole prompt per step
    when prompts are not chunked."""
    budget = DEFAULT_BATCHED_TOKENS.get(device, 2048)
    return budget if chunked_prefill else max(budget, max_model_len)


RECOVER_RETRY_S = (1.0, 30.0)
"""First and longest wait between tries to read the request state from Redis at start."""


@dataclass(slots=True)
class ServiceOptions:
    """Scheduler settings from the CLI; KV geometry comes from the workers."""

    scheduling: str = "async"
    max_inflight: int | None = None
    """Steps in flight; None means 2P (async) or P (sync)."""
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    """None: 512 on CPU stages (short steps: first tokens sooner at the same throughput),
    2048 on GPUs."""
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    policy: str = "fcfs"
    max_waiting: int = 10_000
    block_size: int | None = None
    """When set, must equal the workers' block size."""


@dataclass(slots=True)
class StepCounters:
    num_steps: int = 0
    schedule_s: float = 0.0
    num_reports: int = 0


class SchedulerService:
    """Owns the scheduler core, the pipeline session and the per-request subscriber queues."""

    def __init__(self, options: ServiceOptions, pipeline: Pipeline, store):
        self.options = options
        self.pipeline = pipeline
        self.store = store
        self.scheduler: Scheduler | None = None
        self.info: PipelineInfo | None = None
        self.serving = False
        self.counters = StepCounters()
        self._subscribers: dict[str, list[asyncio.Queue]] = {}
        self._wake = asyncio.Event()
        self._inflight = 0
        self._task: asyncio.Task | None = None
        self._on_serving_change = None
        self.observer = None
        """A `SchedulerObserver` (event trace, spans, metrics), or None: no hook runs."""

    @property
    def inflight(self) -> int:
        return self._inflight

    @property
    def max_inflight(self) -> int:
        num_stages = len(self.pipeline.addresses)
        if self.options.max_inflight:
            return self.options.max_inflight
        return 2 * num_stages if self.options.scheduling == "async" else num_stages

    def on_serving_change(self, callback) -> None:
        self._on_serving_change = callback

    async def start(self) -> None:
        """Waits for every stage, recovers requests from Redis, opens the session."""
        self.info = await self.pipeline.wait_ready()
        opts = self.options
        if opts.block_size and opts.block_size != self.info.block_size:
            raise ConfigError(
                f"--block-size={opts.block_size} but the workers use {self.info.block_size}: "
                "drop the flag or start the workers with the same --block-size"
            )
        max_model_len = min(opts.max_model_len or self.info.max_model_len, self.info.max_model_len)
        max_num_batched_tokens = opts.max_num_batched_tokens or default_batched_tokens(
            self.info.device, opts.enable_chunked_prefill, max_model_len
        )
        config = SchedulerConfig(
            num_blocks=self.info.num_blocks,
            block_size=self.info.block_size,
            max_num_seqs=opts.max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            enable_prefix_caching=opts.enable_prefix_caching,
            enable_chunked_prefill=opts.enable_chunked_prefill,
            policy=opts.policy,
            scheduling=opts.scheduling,
            num_stages=self.info.num_stages,
            max_waiting=opts.max_waiting,
        )
        self.scheduler = await self._recover_state(config)
        if self.observer is not None:
            self.scheduler.outputs.on_state = self.observer.on_state
            for request in self.scheduler.requests.values():  # recovered: first seen here
                self.observer.on_state(request)
        await self._open_session()
        self._task = asyncio.create_task(self._run(), name="scheduler-loop")

    async def _recover_state(self, config: SchedulerConfig) -> Scheduler:
        """`Scheduler.recover` from Redis, retried with backoff while Redis refuses (down, or
        a wrong password): the service stays up and NOT_SERVING and says why once per try,
        rather than exiting into a restart loop."""
        delay_s = RECOVER_RETRY_S[0]
        while True:
            try:
                return await asyncio.to_thread(Scheduler.recover, config, self.store)
            except StateStoreError as exc:
                logger.error("cannot read request state: %s Retrying in %.0f s.", exc, delay_s)
                await asyncio.sleep(delay_s)
                delay_s = min(2 * delay_s, RECOVER_RETRY_S[1])

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self.observer is not None:
            self.observer.close()
        await self.pipeline.shutdown()

    # ------------------------------------------------------------------ requests
    def submit(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        priority: int = 0,
        tenant: str = "",
        weight: float = 0.0,
        traceparent: str | None = None,
    ) -> asyncio.Queue:
        """Queues a request; returns the queue its deltas arrive on. Raises the core's
        errors (QueueFull, PromptTooLong, InvalidRequest, StateStoreError). `traceparent`
        (W3C) names the router's span, the parent of this request's span."""
        if not self.serving or self.scheduler is None:
            raise PipelineUnavailable("the pipeline is not whole: retry in a few seconds")
        if sampling.seed is None and not sampling.is_greedy:
            # A fixed seed makes recompute after preemption or a restart reproduce the tokens.
            sampling.seed = random.getrandbits(63)
        eos = self.info.eos_token_ids[0] if self.info.eos_token_ids else None
        request = Request(
            request_id,
            list(prompt_token_ids),
            sampling,
            priority=priority,
            tenant=tenant or "default",
            weight=weight or 1.0,
            eos_token_id=eos,
        )
        queue: asyncio.Queue = asyncio.Queue()
        self.scheduler.add_request(request)
        if self.observer is not None:
            self.observer.on_submit(request, traceparent)
        self._subscribers.setdefault(request_id, []).append(queue)
        self._wake.set()
        return queue

    def unsubscribe(self, request_id: str, queue: asyncio.Queue) -> None:
        queues = self._subscribers.get(request_id)
        if queues and queue in queues:
            queues.remove(queue)
            if not queues:
                del self._subscribers[request_id]

    def abort(self, request_id: str) -> bool:
        """Aborts an unfinished request; False when it is unknown or already finished."""
        request = self.scheduler.requests.get(request_id) if self.scheduler else None
        if request is None:
            return False
        try:
            self.scheduler.abort_request(request_id)
        except UnknownRequest:
            return False
        try:
            self._publish(self.scheduler.outputs.flush())  # persists the abort now
        except StateStoreError as exc:  # kept buffered; written with the next step
            logger.warning("abort of %s not persisted yet: %s", request_id, exc)
        self._publish([TokenDelta(request_id, [], request.num_output_tokens, "abort")])
        self._wake.set()
        return True

    def attach(self, request_id: str) -> asyncio.Queue | None:
        """A live queue for an unfinished request (Resume), or None if it is not running here."""
        if self.scheduler is None or request_id not in self.scheduler.requests:
            return None
        queue: asyncio.Queue = asyncio.Queue()
        self._subscribers.setdefault(request_id, []).append(queue)
        return queue

    # ------------------------------------------------------------------ the loop
    async def _run(self) -> None:
        while True:
            try:
                await self._dispatch()
                await self._wait_and_process()
            except (PipelineBroken, PipelineUnavailable) as exc:
                await self._recover_pipeline(str(exc))
            except StateStoreError as exc:
                logger.error("%s; retrying in 1 s", exc)
                await asyncio.sleep(1.0)

    async def _dispatch(self) -> None:
        scheduler = self.scheduler
        is_async = self.options.scheduling == "async"
        observer = self.observer
        while self._inflight < self.max_inflight and scheduler.has_unfinished:
            if observer is not None:
                observer.begin_step(scheduler.next_step_id)
            t0 = time.perf_counter()
            plan = scheduler.schedule()
            self.counters.schedule_s += time.perf_counter() - t0
            if not plan.num_requests and not plan.finished_request_ids:
                break
            self.counters.num_steps += 1
            self._inflight += 1
            msg = plan_to_pb(plan, is_async)
            if observer is not None:
                msg.trace_parent = observer.on_plan(plan)
            await self.pipeline.send(msg.SerializeToString())

    async def _wait_and_process(self) -> None:
        reports = self.pipeline.reports
        if reports.empty():
            self._wake.clear()
            getter = asyncio.ensure_future(reports.get())
            waker = asyncio.ensure_future(self._wake.wait())
            # Nothing in flight yet work left (a request waiting out the pipeline rule):
            # plan again soon rather than wait for a report that will not come.
            timeout = 0.05 if self._inflight == 0 and self.scheduler.has_unfinished else None
            done, _ = await asyncio.wait(
                {getter, waker}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
            )
            waker.cancel()
            if getter not in done:
                getter.cancel()
                return
            item = getter.result()
        else:
            item = reports.get_nowait()
        while True:
            self._process(item)
            if reports.empty():
                return
            item = reports.get_nowait()

    def _process(self, item) -> None:
        stage, report = item
        if stage == "error":
            raise PipelineBroken(report)
        self._inflight -= 1
        self.counters.num_reports += 1
        if self.observer is not None:
            self.observer.begin_step(report.step_id)
        deltas = self.scheduler.process_result(result_from_report(report))
        self._publish(deltas)

    def _publish(self, deltas: list[TokenDelta]) -> None:
        for delta in deltas:
            for queue in self._subscribers.get(delta.request_id, ()):
                queue.put_nowait(delta)
            if delta.finish_reason is not None:
                self._subscribers.pop(delta.request_id, None)

    # ------------------------------------------------------------------ failures
    async def _open_session(self) -> None:
        self._inflight = 0
        await self.pipeline.open()
        self._set_serving(True)

    async def _recover_pipeline(self, reason: str) -> None:
        logger.error("pipeline broken: %s; re-queuing running requests", reason)
        self._set_serving(False)
        await self.pipeline.close()
        self.scheduler.requeue_running()
        while True:
            try:
                await self.pipeline.wait_ready()
                break
            except PipelineUnavailable:
                await asyncio.sleep(0.5)
        await self._open_session()
        logger.info("pipeline whole again; resuming %d requests", len(self.scheduler.requests))

    def _set_serving(self, serving: bool) -> None:
        self.serving = serving
        if self._on_serving_change is not None:
            self._on_serving_change(serving)

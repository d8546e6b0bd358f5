"""`SchedulerService`: drives the scheduler core over a live pipeline (no gRPC servicer here).

The loop, on one asyncio task:

    dispatch: while fewer than K steps are in flight, plan a step and send it to every stage
    wait:     for the last stage's report, a new request or an abort
    process:  append the tokens of every report waiting, persist them (one Redis round
              trip, in a thread while the loop goes on planning), then stream the deltas
              to subscribers

In async mode K = 2P: step s+P of a micro-batch is planned and sent before step s has
reported, so stage 0 finds its next plan waiting and takes the input tokens straight from
the last stage. In sync mode K = P and a request waits for its token to come back.
A stage that fails or disappears ends the session: every running request goes back to the
queue, to be recomputed once every stage answers Describe again.

Health tells the truth: SERVING only while the pipeline is whole, the store takes writes
(a failure shorter than `store_grace_s` is ridden out) and the loop runs. A request nobody
listens to any more (its router died, its client went away) is aborted after
`orphan_timeout_s`, so no KV is held for nobody. An unexpected exception in the loop ends
it; `loop_done()` then returns and the process exits non-zero, for a supervisor to restart.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

from services.common.errors import (
    InvalidRequest,
    PipelineUnavailable,
    StateStoreError,
    StoreLost,
    UnknownRequest,
)
from services.common.pb import plan_to_pb, result_from_report
from services.common.sampling import SamplingParams
from services.common.step import StepPlan
from services.scheduler.config import SchedulerConfig
from services.scheduler.drafts import DraftClient
from services.scheduler.lead import Lead
from services.scheduler.ownership import Tombstones, is_owner
from services.scheduler.pipeline import (
    Pipeline,
    PipelineBroken,
    PipelineInfo,
    PlanWait,
    StageFailure,
    StageReport,
    plan_wait_of,
)
from services.scheduler.request import Request
from services.scheduler.scheduler import PauseMode, Scheduler
from services.scheduler.state import StateStore, TokenDelta
from services.scheduler.updates import Batch
from services.scheduler.validation import validate_submission

logger = logging.getLogger(__name__)


RECOVER_RETRY_S = (1.0, 5.0)
"""First and longest wait between tries to read the request state from Redis at start."""
OPEN_RETRY_S = (0.5, 8.0)
"""First and longest wait between tries to open a session the stages did not take: each try
leaves a thread per stage in a rendezvous that cannot end (up to gloo's op timeout, 120 s)
where the stages cannot meet."""
HUNG_RECHECK_S = 1.0
"""Past --step-timeout the loop waits this much more for a report before it calls a stage
hung: a scheduler that was itself paused has its reports still unread in the sockets."""


class Subscriber(Protocol):
    """Where a request's deltas go: an asyncio.Queue (Submit, Resume) or a session's stream.
    `put_nowait` is called from the scheduling loop and must not block."""

    def put_nowait(self, delta: TokenDelta) -> None: ...


class SchedulerHooks(Protocol):
    """What the service tells its observer (services/scheduler/observability.py: the event
    trace, spans and metrics)."""

    def on_submit(self, request: Request, traceparent: str | None) -> None: ...

    def on_state(self, request: Request) -> None: ...

    def begin_step(self, step_id: int) -> None: ...

    def on_plan(self, plan: StepPlan) -> str:
        """Returns the step's trace parent (W3C), or ""."""

    def close(self) -> None: ...


@dataclass(slots=True)
class StepCounters:
    num_steps: int = 0
    schedule_s: float = 0.0
    num_reports: int = 0


class SchedulerService:
    """Owns the scheduler core, the pipeline session and the per-request subscriber queues."""

    def __init__(self, config: SchedulerConfig, pipeline: Pipeline, store: StateStore):
        self.config = config
        """The flags until the pipeline is whole; then resolved against the workers."""
        self.pipeline = pipeline
        self.store = store
        self.scheduler: Scheduler | None = None
        self.info: PipelineInfo | None = None
        self.counters = StepCounters()
        self.not_serving_reason: str | None = "starting: waiting for the pipeline"
        """Why health is NOT_SERVING (None while SERVING)."""
        self._is_pipeline_whole = False
        self._store_failing_since: float | None = None
        self._store_error: str | None = None
        self._orphaned_at: dict[str, float] = {}
        """Unfinished requests without a subscriber, and since when (monotonic s)."""
        self._step_requests: dict[int, list[str]] = {}
        """The requests of every step in flight (a stage failure names its step)."""
        self._progress_at = 0.0
        """When a step last finished, or the first of those in flight was sent (monotonic s):
        the start of the wait `step_timeout_s` bounds."""
        self._reaper: asyncio.Task | None = None
        self._watcher: asyncio.Task | None = None
        self._subscribers: dict[str, list[Subscriber]] = {}
        self._tombstones = Tombstones()
        self._wake = asyncio.Event()
        self._inflight = 0
        self.lead: Lead | None = None
        """Async mode without --max-inflight: the window's lead over P, adapting."""
        self._held_ns = 0
        """How long the loop last sat idle with a full window and requests unfinished: the
        window held the next dispatch's plans back that long (the lead counts that much of
        stage 0's wait for them, services/scheduler/lead.py)."""
        self._writer: asyncio.Task | None = None
        """The write of processed steps in flight (`_write_behind`), or None."""
        self._held: list[TokenDelta] = []
        """Ends of streams (an abort, a failure) whose state change waits behind the write in
        flight: published after the next write, not before the state they announce."""
        self._write_failed = False
        """The last write in the background failed: the loop writes the next itself."""
        self.writes_refused = asyncio.Event()
        """Set when the store refused a write (another pipeline adopted the request): the
        peers task lets go at once rather than at its next tick (services/scheduler/peers.py)."""
        self._task: asyncio.Task | None = None
        self._on_serving_change = None
        self.observer: SchedulerHooks | None = None
        """The event trace, spans and metrics, or None: no hook runs."""
        self.pause_mode: PauseMode | None = None
        """Set while paused (Pause); health stays SERVING: Submit still queues."""
        self.weight_version = 0
        """The version of the weights every stage serves (UpdateWeights)."""
        self.num_weight_updates = 0
        self._quiet = asyncio.Event()
        """Set by the loop while paused once nothing is in flight (WAIT: nothing runs)."""
        self._weights_problem: str | None = None
        """Why the stages cannot serve together (they hold different weights), or None."""
        self.drafts: DraftClient | None = None
        """The draft worker's client (a "draft_model" speculative config), or None."""

    @property
    def inflight(self) -> int:
        return self._inflight

    @property
    def max_inflight(self) -> int:
        """Steps in flight at most now: --max-inflight, P (sync) or P + the lead (async)."""
        if self.lead is not None:
            return self.lead.window
        return self.config.steps_in_flight

    @property
    def serving(self) -> bool:
        return self.not_serving_reason is None

    def on_serving_change(self, callback) -> None:
        self._on_serving_change = callback

    async def start(self) -> None:
        """Waits for every stage, recovers requests from Redis, opens the session."""
        try:  # say now what is wrong with Redis (a password), not once the stages are up
            await asyncio.to_thread(self.store.check)
        except StateStoreError as exc:
            logger.error("%s (the scheduler waits for its stages, then tries again)", exc)
        self.info = await self.pipeline.wait_ready()
        self._check_stage_weights(self.info.weight_versions)
        self.config = config = self.config.resolved(self.info)
        if config.is_async and not config.max_inflight:
            self.lead = Lead(config.num_stages)
        self.pipeline.reads_plan_waits = self.lead is not None
        spec = config.speculative
        if spec is not None and spec.uses_draft_model:
            security = getattr(self.pipeline, "security", None)
            self.drafts = DraftClient(
                config.draft_worker, self.info.vocab_size, spec.draft_timeout_s, security
            )
        self.scheduler = await self._recover_state(config)
        now = time.monotonic()
        for request_id in self.scheduler.requests:  # recovered: their routers must Resume
            self._orphaned_at[request_id] = now
        if self.observer is not None:
            self.scheduler.outputs.on_state = self.observer.on_state
            for request in self.scheduler.requests.values():  # recovered: first seen here
                self.observer.on_state(request)
        await self._open_session()
        self._task = asyncio.create_task(self._run(), name="scheduler-loop")
        self._reaper = asyncio.create_task(self._reap_orphans(), name="orphan-reaper")
        self._watcher = asyncio.create_task(self._watch_store(), name="store-watcher")

    async def _recover_state(self, config: SchedulerConfig) -> Scheduler:
        """`Scheduler.recover` from Redis, retried with backoff while Redis refuses (down, or
        a wrong password): the service stays up and NOT_SERVING and says why once per try,
        rather than exiting into a restart loop."""
        delay_s = RECOVER_RETRY_S[0]
        while True:
            try:
                return await asyncio.to_thread(Scheduler.recover, config, self.store)
            except StateStoreError as exc:
                self.not_serving_reason = f"cannot read request state from Redis: {exc}"
                logger.error("cannot read request state: %s Retrying in %.0f s.", exc, delay_s)
                await asyncio.sleep(delay_s)
                delay_s = min(2 * delay_s, RECOVER_RETRY_S[1])

    async def loop_done(self) -> BaseException | None:
        """Returns when the scheduling loop ended (it never does unless it failed), with the
        exception that ended it."""
        while self._task is None:
            await asyncio.sleep(0.1)
        await asyncio.gather(self._task, return_exceptions=True)
        return None if self._task.cancelled() else self._task.exception()

    async def stop(self) -> None:
        for task in (self._task, self._reaper, self._watcher):
            if task:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        if self._writer is not None:  # let the write in flight land
            await asyncio.wait({self._writer}, timeout=5.0)
        if self.observer is not None:
            self.observer.close()
        if self.drafts is not None:
            await self.drafts.close()
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
        owner_token: str = "",
        subscriber: Subscriber | None = None,
    ) -> Subscriber:
        """Queues a request; returns the subscriber its deltas are put to (`subscriber`, or a
        new asyncio.Queue). Raises the core's errors (QueueFull, PromptTooLong,
        InvalidRequest, StateStoreError). `traceparent` (W3C) names the router's span, the
        parent of this request's span. `request_id` is the namespaced key
        (ownership.request_key); an abort of it with `owner_token` that came first ends the
        deltas at once with "abort", and nothing runs."""
        queue = subscriber if subscriber is not None else asyncio.Queue()
        if self._tombstones.take(request_id, owner_token):
            logger.info("%s was aborted before its Submit arrived: not queued", request_id)
            queue.put_nowait(TokenDelta(request_id, [], 0, "abort"))
            return queue
        if not self.serving or self.scheduler is None:
            raise PipelineUnavailable(
                f"the scheduler is not serving ({self.not_serving_reason}): retry in a few seconds"
            )
        validate_submission(
            self.config,
            self.info.vocab_size,
            request_id,
            prompt_token_ids,
            sampling,
            priority,
            tenant,
            weight,
        )
        if sampling.seed is None and not sampling.is_greedy:
            # A fixed seed makes recompute after preemption or a restart reproduce the tokens.
            sampling.seed = random.getrandbits(63)
        tenant = tenant or "default"
        request = Request(
            request_id,
            list(prompt_token_ids),
            sampling,
            priority=priority,
            tenant=tenant,
            weight=weight or 1.0,
            eos_token_ids=tuple(self.info.eos_token_ids),
            extra_key=Request.cache_salt(tenant),
            owner_token=owner_token,
        )
        self.scheduler.add_request(request)
        if self.observer is not None:
            self.observer.on_submit(request, traceparent)
        self._subscribers.setdefault(request_id, []).append(queue)
        self._wake.set()
        return queue

    def unsubscribe(self, request_id: str, queue: Subscriber) -> None:
        """The stream reading `queue` ended; a request left without any is an orphan."""
        queues = self._subscribers.get(request_id)
        if queues and queue in queues:
            queues.remove(queue)
            if not queues:
                del self._subscribers[request_id]
                if self.scheduler is not None and request_id in self.scheduler.requests:
                    self._orphaned_at[request_id] = time.monotonic()

    def abort(self, request_id: str, owner_token: str = "") -> bool:
        """Aborts an unfinished request submitted with `owner_token`; False when it is unknown,
        already finished or someone else's. An abort of an unknown request is remembered: if
        its Submit arrives after all, it is aborted on arrival."""
        request = self.scheduler.requests.get(request_id) if self.scheduler else None
        if request is None:
            self._tombstones.add(request_id, owner_token)
            return False
        if not is_owner(request.owner_token, owner_token):
            return False
        return self._abort(request)

    def _abort(self, request: Request, reason: str | None = None) -> bool:
        """Aborts `request` (whoever owns it: the caller checked) and tells its streams,
        with `reason` in the last delta's `error` when the scheduler itself aborts it."""
        request_id = request.request_id
        try:
            self.scheduler.abort_request(request_id)
        except UnknownRequest:
            return False
        delta = TokenDelta(request_id, [], request.num_output_tokens, "abort", error=reason)
        self._persist_then_publish(delta, f"abort of {request_id}")
        self._wake.set()
        return True

    # ------------------------------------------------------------------ many pipelines
    def adopt(self, requests: list[Request]) -> None:
        """Runs requests adopted from a lost pipeline (their ownership already moved here
        in Redis): queued and recomputed from prompt and outputs so far. They are orphans
        until a router resumes them."""
        # The routers find them after their resumes back off (up to 2 s) and learn the new
        # owner: the orphan clock starts an announcement TTL later.
        now = time.monotonic() + self.config.announce_ttl_s
        for request in requests:
            self.scheduler.readmit(request)
            if self.observer is not None:
                self.observer.on_state(request)
            if request.request_id in self.scheduler.requests:
                self._orphaned_at.setdefault(request.request_id, now)
        self._wake.set()

    def release(self, owners: dict[str, str]) -> None:
        """Drops requests another pipeline adopted (`owners`: id -> that pipeline), after
        this one was NOT_SERVING too long; their streams end naming where to resume."""
        for request_id, owner_pipeline_id in owners.items():
            request = self.scheduler.release(request_id) if self.scheduler else None
            # One that finished here since has streamed nothing of its refused tokens and
            # end: its streams are still open and must hear where it went.
            queues = self._subscribers.pop(request_id, ())
            if request is None and not queues:
                continue
            logger.warning("%s was adopted by pipeline %s: dropped", request_id, owner_pipeline_id)
            moved = TokenDelta(request_id, [], request.num_output_tokens if request else 0, None)
            moved.owner_pipeline_id = owner_pipeline_id
            for queue in queues:
                queue.put_nowait(moved)
            self._orphaned_at.pop(request_id, None)
        self._wake.set()

    def attach(self, request_id: str) -> asyncio.Queue | None:
        """A live queue for an unfinished request (Resume), or None if it is not running here."""
        if self.scheduler is None or request_id not in self.scheduler.requests:
            return None
        queue: asyncio.Queue = asyncio.Queue()
        self._subscribers.setdefault(request_id, []).append(queue)
        self._orphaned_at.pop(request_id, None)
        return queue

    async def resume(
        self, request_id: str, offset: int = 0, owner_token: str | None = ""
    ) -> AsyncIterator[TokenDelta]:
        """A request's tokens from `offset` on: what the store holds, then the live ones
        until it finishes (a router whose stream broke picks up where it was). Raises
        `UnknownRequest` when the request is neither here nor in the store, or was submitted
        with another owner token (the same answer: ids cannot be probed). `owner_token`
        None resumes whichever submission holds the id (the public Resume: `request_id` is
        already in the principal's namespace). The first delta carries the prompt's length
        and refuses an `offset` past the tokens that exist (InvalidRequest)."""
        request = self.scheduler.requests.get(request_id) if self.scheduler else None
        if request is not None:
            owner = request.owner_token
        else:
            owner = await asyncio.to_thread(self.store.read_owner_token, request_id)
        if owner is None or (owner_token is not None and not is_owner(owner, owner_token)):
            raise UnknownRequest(f"request {request_id} is not known (or expired)")
        queue = self.attach(request_id)  # attach first: no token slips in between
        try:
            try:
                status = await asyncio.to_thread(self.store.read_state, request_id)
                tokens = await asyncio.to_thread(self.store.read_tokens, request_id, 0)
                owner_pipeline = None
                if queue is None and status is not None and not status.is_finished:
                    owner_pipeline = await asyncio.to_thread(
                        self.store.read_owner_pipeline, request_id
                    )
            except StateStoreError as exc:
                raise PipelineUnavailable(f"cannot read request {request_id}: {exc}") from exc
            if status is None and queue is not None:  # live here, but Redis lost it
                raise PipelineUnavailable(
                    f"request {request_id} is being written to Redis again: retry in a moment"
                )
            if status is None:
                raise UnknownRequest(f"request {request_id} is not known (or expired)")
            # Not running here (and not finished: a restarted scheduler still recovering):
            # the stream ends without a finish reason and the router resumes again later.
            is_done = queue is None or status.is_finished
            if offset > len(tokens):
                raise InvalidRequest(
                    f"offset={offset} is beyond request {request_id.rsplit('/', 1)[-1]}'s "
                    f"output: it has {len(tokens)} tokens so far (resume from at most that)"
                )
            first = TokenDelta(request_id, tokens[offset:], offset, status.finish_reason)
            if request is not None:
                first.num_prompt_tokens = len(request.prompt_token_ids)
            else:
                first.num_prompt_tokens = await asyncio.to_thread(
                    self.store.read_prompt_len, request_id
                )
            if owner_pipeline is not None and owner_pipeline != self.config.pipeline_id:
                first.owner_pipeline_id = owner_pipeline  # resume there
            yield first
            delivered = len(tokens)
            while not is_done:
                delta = await queue.get()
                if delta.owner_pipeline_id is not None:  # released: adopted elsewhere
                    moved = TokenDelta(request_id, [], delivered, None)
                    moved.owner_pipeline_id = delta.owner_pipeline_id
                    yield moved
                    return
                skip = max(0, delivered - delta.offset)
                if skip:  # already read from the store
                    delta = TokenDelta(
                        request_id,
                        delta.token_ids[skip:],
                        delta.offset + skip,
                        delta.finish_reason,
                        delta.logprobs[skip:] if delta.logprobs else None,
                    )
                delivered = max(delivered, delta.offset + len(delta.token_ids))
                if delta.token_ids or delta.finish_reason is not None:
                    yield delta
                is_done = delta.finish_reason is not None
        finally:
            if queue is not None:
                self.unsubscribe(request_id, queue)

    # ------------------------------------------------------------------ the loop
    async def _run(self) -> None:
        while True:
            try:
                if self._store_failing_since is not None or self._write_failed:
                    await self._flush_now()
                await self._dispatch()
                self._note_quiet()
                await self._wait_and_process()
                self._store_ok()
            except PipelineBroken as exc:
                await self._recover_pipeline(str(exc), exc.request_ids)
            except PipelineUnavailable as exc:
                await self._recover_pipeline(str(exc))
            except StateStoreError as exc:
                self._held_ns = 0  # the store, not the window, held plans back
                self._store_failed(exc)
                await asyncio.sleep(0.5)

    async def _dispatch(self) -> None:
        if self._weights_problem is not None:
            return  # no step on a mix of weights; UpdateWeights makes the stages agree
        scheduler = self.scheduler
        is_async = self.config.is_async
        observer = self.observer
        max_inflight = self.max_inflight
        lead, held_ns = self.lead, 0
        if self._inflight < max_inflight:  # the window lets plans out: its hold ends here
            held_ns, self._held_ns = self._held_ns, 0
        while self._inflight < max_inflight and scheduler.has_unfinished:
            if observer is not None:
                observer.begin_step(scheduler.next_step_id)
            proposals = None
            if self.drafts is not None:  # never fails: no answer in time means no proposals
                candidates = scheduler.draft_candidates(self._inflight)
                if candidates:
                    proposals = await self.drafts.propose(candidates, scheduler.requests)
            t0 = time.perf_counter()
            plan = scheduler.schedule(proposals, self._inflight)
            self.counters.schedule_s += time.perf_counter() - t0
            if not plan.num_requests and not plan.finished_request_ids:
                if scheduler.skip_to_next_ready(plan.step_id):
                    continue
                break
            self.counters.num_steps += 1
            if self._inflight == 0:
                self._progress_at = time.monotonic()
            self._inflight += 1
            if lead is not None:
                lead.planned(plan.step_id, held_ns)
            self._step_requests[plan.step_id] = [
                r.request_id for r in (*plan.new_requests, *plan.cached_requests)
            ]
            msg = plan_to_pb(plan, is_async)
            if observer is not None:
                msg.trace_parent = observer.on_plan(plan)
            await self.pipeline.send(msg.SerializeToString())

    async def _wait_and_process(self) -> None:
        reports = self.pipeline.reports
        if reports.empty():
            is_full = self._inflight >= self.max_inflight and self.scheduler.has_unfinished
            idle_since = time.monotonic_ns()
            self._wake.clear()
            getter = asyncio.ensure_future(reports.get())
            waker = asyncio.ensure_future(self._wake.wait())
            # Nothing in flight yet work left (a request waiting out the pipeline rule):
            # plan again soon rather than wait for a report that will not come.
            is_idle = self._inflight == 0 and self.pause_mode is None
            timeout = 0.05 if is_idle and self.scheduler.has_unfinished else None
            if self._inflight:  # a hung stage must not hold the loop (and health) forever
                due = self._progress_at + self.config.step_timeout_s
                timeout = max(0.0, due - time.monotonic())
            done, _ = await asyncio.wait(
                {getter, waker}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
            )
            waker.cancel()
            # A full window kept the loop from planning all this time (a wake for a new
            # request while full adds to it); idle for want of work, nothing was held.
            self._held_ns = self._held_ns + time.monotonic_ns() - idle_since if is_full else 0
            if getter in done:
                item = getter.result()
            else:
                getter.cancel()
                if not (self._inflight and self._is_step_overdue()):
                    return
                # This process stalled (a paused VM) looks the same: reports may wait in
                # the sockets, unread. Let the readers run before blaming a stage.
                try:
                    item = await asyncio.wait_for(reports.get(), HUNG_RECHECK_S)
                except TimeoutError:
                    raise self._hung() from None
        else:
            item = reports.get_nowait()
        # Every report waiting is applied, then persisted in one round trip: a scheduler that
        # falls behind catches up with one Redis write for several steps. The write runs in
        # a thread while the loop plans and sends the next step.
        broken = None
        while True:
            try:
                self._apply(item)
            except PipelineBroken as exc:
                broken = exc
                break
            if reports.empty():
                break
            item = reports.get_nowait()
        if broken is None:
            self._write_behind()
            return
        try:  # the steps that did report keep their tokens
            await self._flush_now()
        except StateStoreError as exc:  # kept buffered; written with the next step
            logger.warning("tokens before the pipeline broke not persisted yet: %s", exc)
        raise broken

    def _apply(self, item: StageReport | PlanWait | StageFailure) -> None:
        lead = self.lead
        if isinstance(item, PlanWait):
            if lead is not None:
                lead.waited(item.step_id, item.wait_ns)
            return
        if isinstance(item, StageFailure):
            raise PipelineBroken(item.message, self._step_requests.get(item.step_id))
        report = item.report
        if lead is not None:
            if item.stage == 0 and report.plan_wait_ns > 0:  # one stage: first and last
                lead.waited(report.step_id, plan_wait_of(report))
            lead.reported(report.step_id, time.monotonic_ns())
        self._step_requests.pop(report.step_id, None)
        self._inflight -= 1
        self._progress_at = time.monotonic()
        self.counters.num_reports += 1
        if self.observer is not None:
            self.observer.begin_step(report.step_id)
        try:
            result = result_from_report(report)
            runs = self.scheduler.check_result(result)
        except ValueError as exc:  # a stage that sends nonsense is broken: re-form the pipeline
            raise PipelineBroken(f"stage {item.stage} sent a malformed report: {exc}") from exc
        self.scheduler.apply_result(result, runs)

    def _is_step_overdue(self) -> bool:
        return time.monotonic() - self._progress_at >= self.config.step_timeout_s

    def _hung(self) -> PipelineBroken:
        """No step finished for `step_timeout_s`: the oldest step's requests are suspects
        (a step too long for a stage fails alone, a hung stage fails whatever runs)."""
        oldest = next(iter(self._step_requests), None)
        return PipelineBroken(
            f"no step finished for {self.config.step_timeout_s:g} s with {self._inflight} in "
            "flight (--step-timeout): a stage is hung, or the step is too long for it",
            self._step_requests.get(oldest),
        )

    # ------------------------------------------------------------------ persisting
    def _write_behind(self) -> None:
        """Persists what the processed reports buffered in a thread, while the loop plans
        and sends the next step (the Redis round trip is time the loop would otherwise
        wait), and publishes the deltas once written: no client sees a token the store
        lacks. One write at a time, so that a request's writes land in order: what is
        buffered meanwhile goes with the next, which the write in flight starts as it ends."""
        outputs = self.scheduler.outputs
        if self._writer is not None or self._write_failed:
            return
        if not outputs.has_buffered() and not self._held:
            return
        batch = outputs.take()
        held, self._held = self._held, []
        self._writer = asyncio.create_task(self._write(batch, held), name="state-writer")

    async def _write(self, batch: Batch, held: list[TokenDelta]) -> None:
        outputs = self.scheduler.outputs
        try:
            if batch.updates:
                await asyncio.to_thread(outputs.write, batch)
                if batch.moved:
                    self.writes_refused.set()
        except Exception as exc:  # StoreLost too: the loop's own flush rewrites or retries
            outputs.give_back(batch)
            self._held[:0] = held
            self._write_failed = True
            if isinstance(exc, StateStoreError) and not isinstance(exc, StoreLost):
                self._store_failed(exc)  # the outage counts from here for health
            self._wake.set()
            return
        finally:
            self._writer = None
        self._publish(outputs.done(batch))
        self._publish(held)
        self._write_behind()

    async def _flush_now(self) -> None:
        """Persists what is buffered in the loop's thread, after the write in flight, and
        publishes it. Raises `StateStoreError` (everything stays buffered)."""
        while self._writer is not None:  # one may start the next as it ends
            await asyncio.wait({self._writer})
        self._write_failed = False
        self._flush_buffered()

    def _flush_buffered(self) -> None:
        """While the store fails: send what is buffered again (even with no step left to
        process, the last tokens of finished requests must reach their clients). Leaves it
        to the write in flight, if any."""
        if self._writer is not None:
            return
        self._publish(self.scheduler.outputs.flush())
        held, self._held = self._held, []
        self._publish(held)

    def _persist_then_publish(self, last: TokenDelta, what: str) -> None:
        """Persists what is buffered now (`what` changed: an abort, a failure) and publishes
        it, then `last`, the end of a stream. Behind a write in flight both wait for the
        next write instead."""
        if self._writer is not None:
            self._held.append(last)
            return
        try:
            self._flush_buffered()
        except StateStoreError as exc:  # kept buffered; written with the next step
            logger.warning("%s not persisted yet: %s", what, exc)
        self._publish([last])

    def _publish_failure(self, request: Request, reason: str) -> None:
        """Ends a failed request's streams with finish reason `error` and the reason."""
        delta = TokenDelta(request.request_id, [], request.num_output_tokens, "error", error=reason)
        self._persist_then_publish(delta, f"failure of {request.request_id}")

    def _publish(self, deltas: list[TokenDelta]) -> None:
        for delta in deltas:
            delta.weight_version = self.weight_version
            for queue in self._subscribers.get(delta.request_id, ()):
                queue.put_nowait(delta)
            if delta.finish_reason is not None:
                self._subscribers.pop(delta.request_id, None)

    # ------------------------------------------------------------------ pause
    async def pause(self, mode: PauseMode) -> int:
        """Pauses as `mode` says; returns once it holds (nothing in flight; WAIT: nothing
        running), with the number of requests aborted (ABORT)."""
        if self.scheduler is None:
            raise PipelineUnavailable("the scheduler is still starting: retry in a few seconds")
        self.pause_mode = self.scheduler.pause_mode = mode
        num_aborted = 0
        if mode is PauseMode.ABORT:
            reason = "aborted by an operator's Pause(mode=abort); submit it again"
            for request in list(self.scheduler.running.values()):
                num_aborted += self._abort(request, reason)
        logger.info(
            "pausing (%s): %d running, %d aborted",
            mode.value,
            len(self.scheduler.running),
            num_aborted,
        )
        self._quiet.clear()
        self._wake.set()
        await self._quiet.wait()
        return num_aborted

    def restore_pause(self, mode: PauseMode | None) -> None:
        """Back to the pause state `mode` (None: unpaused) without waiting for it to hold."""
        if mode is None:
            self.unpause()
        else:
            self.pause_mode = self.scheduler.pause_mode = mode
            self._wake.set()

    def unpause(self) -> None:
        if self.scheduler is not None:
            self.scheduler.pause_mode = None
        if self.pause_mode is not None:
            logger.info("unpaused: %d queued requests", self.scheduler.num_waiting)
        self.pause_mode = None
        self._wake.set()

    def weights_changed(self, version: int, recompute_running: bool) -> None:
        """Every stage serves weights `version` now (call while paused, nothing in flight):
        the prefix cache forgets blocks computed before; running requests are recomputed
        when asked."""
        self.weight_version = version
        self.num_weight_updates += 1
        if self._weights_problem is not None:
            logger.info("every stage serves weights version %d again", version)
            self._weights_problem = None
            self._update_health()
        self.scheduler.block_manager.invalidate_prefix_cache()
        if recompute_running:
            num = self.scheduler.recompute_running()
            logger.info("recomputing %d running requests under weights version %d", num, version)

    @property
    def is_pipeline_whole(self) -> bool:
        return self._is_pipeline_whole

    @property
    def stages_disagree(self) -> bool:
        """The stages serve different weights (one restarted since an update)."""
        return self._weights_problem is not None

    def stages_diverged(self, reason: str) -> None:
        """Some stages may serve other weights than the rest: step nothing until an update."""
        self._weights_problem = f"{reason}; run UpdateWeights (every layer) so that they agree"
        logger.error("%s", self._weights_problem)
        self._update_health()

    def _check_stage_weights(self, versions: list[int]) -> None:
        """Adopts the stages' weight version when they agree (a restarted scheduler); else
        stops stepping: a stage that restarted after an update serves --model again."""
        if len(set(versions)) <= 1:
            version = versions[0] if versions else 0
            if version != self.weight_version:
                logger.info("the stages serve weights version %d", version)
                self.weight_version = version
            self._weights_problem = None
            return
        self._weights_problem = (
            f"the stages serve different weights (versions {versions}, in --workers order): a stage "
            "restarted and loaded --model again; run UpdateWeights (every layer) so that "
            "they agree"
        )
        logger.error("%s", self._weights_problem)

    def _note_quiet(self) -> None:
        mode = self.pause_mode
        is_drained = mode is not PauseMode.WAIT or not self.scheduler.running
        if mode is not None and self._inflight == 0 and is_drained:
            self._quiet.set()

    # ------------------------------------------------------------------ failures
    async def _open_session(self) -> None:
        """Opens a session that every stage took; until then health stays NOT_SERVING, and a
        refusal (a stage another scheduler's session holds) is retried from Describe on."""
        last_problem, delay_s = None, OPEN_RETRY_S[0]
        while True:
            try:
                await self.pipeline.open()
                break
            except PipelineUnavailable as exc:
                problem = f"pipeline not whole: {exc}"
                if problem != last_problem:
                    logger.error("%s; retrying", problem)
                    last_problem = problem
                self._update_health(problem)
                await asyncio.sleep(delay_s)
                delay_s = min(2 * delay_s, OPEN_RETRY_S[1])
                await self._wait_for_stages()
        self._inflight = 0
        self._held_ns = 0
        if self.lead is not None:
            self.lead.reset()
        self._is_pipeline_whole = True
        self._update_health()

    async def _wait_for_stages(self, cause: str | None = None) -> None:
        """Until every stage answers Describe; health says what is missing meanwhile (after
        `cause`, what broke the pipeline)."""
        while True:
            try:  # wait_ready logs each new problem
                info = await self.pipeline.wait_ready(timeout_s=2.0)
                self._check_stage_weights(info.weight_versions)
                return
            except PipelineUnavailable as exc:
                self._update_health(f"{cause}; now {exc}" if cause else str(exc))

    def _store_failed(self, exc: StateStoreError) -> None:
        now = time.monotonic()
        if self._store_failing_since is None:
            self._store_failing_since = now
            logger.error("%s; retrying (tokens stay buffered meanwhile)", exc)
        if now - self._store_failing_since >= self.config.store_grace_s:
            self._store_error = (
                f"Redis unavailable for {now - self._store_failing_since:.0f} s: {exc}"
            )
            self._update_health()

    def _store_ok(self) -> None:
        if self._store_failing_since is not None and not self.scheduler.outputs.pending_updates():
            logger.info("Redis writes succeed again")
            self._store_failing_since = self._store_error = None
            self._update_health()

    async def _watch_store(self) -> None:
        """Checks the store every second, busy or idle: a Redis that restarted (empty, or from
        an older snapshot) is rewritten from memory at once, and one that does not answer
        turns health NOT_SERVING past the grace period even when no step needs it."""
        while True:
            await asyncio.sleep(1.0)
            try:
                await asyncio.to_thread(self.store.check)
                if self._store_failing_since is not None:
                    self._flush_buffered()
            except StoreLost as exc:
                if self.scheduler.outputs.is_writing:
                    continue  # that write will find the loss itself, and the loop rewrite
                try:
                    self.scheduler.outputs.rewrite(exc)
                except StateStoreError as again:
                    self._store_failed(again)
                    continue
            except StateStoreError as exc:
                self._store_failed(exc)
                continue
            self._store_ok()

    async def _reap_orphans(self) -> None:
        """Aborts requests nobody has listened to for `orphan_timeout_s`."""
        timeout = self.config.orphan_timeout_s
        while True:
            await asyncio.sleep(min(1.0, timeout / 2))
            now = time.monotonic()
            expired = [r for r, since in self._orphaned_at.items() if now - since >= timeout]
            for request_id in expired:
                del self._orphaned_at[request_id]
                request = self.scheduler.requests.get(request_id) if self.scheduler else None
                if request is not None and request_id not in self._subscribers:
                    logger.info("aborting %s: nobody listened for %.0f s", request_id, timeout)
                    self._abort(request)

    async def _recover_pipeline(self, reason: str, failed_step: list[str] | None = None) -> None:
        """Re-forms the pipeline. `failed_step`: the requests of the step a stage failed on;
        they run alone next, and one a stage fails on alone is failed (a poison request)."""
        logger.error("pipeline broken: %s; re-queuing running requests", reason)
        self._is_pipeline_whole = False
        self._update_health(f"pipeline not whole: {reason}")
        self._step_requests.clear()
        for request in self.scheduler.step_failed(failed_step or [], reason):
            logger.error("failed %s: a stage failed on it alone: %s", request.request_id, reason)
            self._publish_failure(request, reason)
        await self.pipeline.close()
        self.scheduler.requeue_running()
        await self._wait_for_stages(f"pipeline not whole: {reason}")
        await self._open_session()
        logger.info("pipeline whole again; resuming %d requests", len(self.scheduler.requests))

    def _update_health(self, pipeline_problem: str = "pipeline not whole") -> None:
        was_serving = self.serving
        if not self._is_pipeline_whole:
            self.not_serving_reason = pipeline_problem
        else:
            self.not_serving_reason = self._store_error or self._weights_problem
        if self.serving != was_serving:
            if not self.serving:
                logger.warning("NOT_SERVING: %s", self.not_serving_reason)
            if self._on_serving_change is not None:
                self._on_serving_change(self.serving)

"""`StageEngine`: one stage's step loop, joining the runner to the stage transport.

Plans arrive (from the scheduler's Run stream) in step order and are executed one at a time
on a dedicated compute thread:

    stage 0:   [async: take tokens of steps <= s-P from the last stage] → embed + layers → send
    stage i:   recv hidden → layers → send
    last:      recv hidden → layers → logits → sample → [async: send tokens to stage 0] → report

Only the last stage reports each step; other stages report failures, and stage 0 in async
mode a step whose plan came late (the scheduler's window grows on those). Every stage keeps
a timeline (compute start/end and the time it waited for another stage) for the bubble.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from services.common.step import StepPlan, StepResult
from services.worker.runner import StageRunner
from services.worker.transport import Link, Transport

logger = logging.getLogger(__name__)

_MAX_TIMELINE = 200_000
# Gaps longer than this between two steps mean the pipeline had no work, not a bubble.
_IDLE_GAP_NS = 500_000_000
PLAN_WAIT_REPORTED = 0.02
"""Stage 0 tells the scheduler of a plan wait longer than this share of its previous step
(shorter ones are noise to the scheduler's window, services/scheduler/lead.py)."""
_RECEIVES_AHEAD = 4
"""Plans a stage takes off its queue ahead of the one it runs, to post their activations'
receives before it computes (transport.py: gloo sends a message once its receive is posted)."""

_session_threads: weakref.WeakSet[threading.Thread] = weakref.WeakSet()


def session_threads_alive() -> bool:
    """Whether a session's compute thread still runs: once its session ended, it is inside
    torch.distributed's C++ code (a peer wait, or a rendezvous that has not ended)."""
    return any(thread.is_alive() for thread in _session_threads)


@dataclass(slots=True)
class StepRecord:
    """One step as this stage lived it (wall-clock ns)."""

    step_id: int
    num_requests: int
    num_tokens: int
    start_ns: int
    end_ns: int
    wait_ns: int
    collective_ns: int = 0
    """Of the compute, the time in tensor-parallel collectives (model/tensor_parallel.py)."""
    plan_wait_ns: int = 0
    """How long after this stage's previous step ended the step's plan arrived (0: it was
    there already): the part of the gap before the step that the control plane left."""


@dataclass(slots=True)
class StepOutcome:
    """What the engine hands back for one plan: a result (last stage) or an error."""

    step_id: int
    record: StepRecord | None
    result: StepResult | None = None
    error: str | None = None
    plan_wait_ns: int = 0
    """Stage 0, async plans: the step's plan wait when the scheduler should hear of it
    (more than `PLAN_WAIT_REPORTED` of a step); 0 otherwise."""


@dataclass(slots=True)
class _Session:
    """One Run stream's worth of work: its plans, its callback, its rendezvous epoch."""

    plans: queue.Queue
    on_outcome: Callable[[StepOutcome], None]
    epoch: int
    on_joined: Callable[[str | None], None] | None = None
    thread: threading.Thread | None = None
    link: Link | None = None
    broken: str | None = None
    """Why the session cannot run plans any more (each later plan is answered with it)."""
    is_stale: bool = False
    """Set when the session ended; a thread still running it must leave the runner alone."""
    joining: bool = True
    """Its thread is still in the rendezvous (`transport.connect`), touching nothing else."""
    pending_tokens: dict[str, int] = field(default_factory=dict)
    """Stage 0, async: tokens from the last stage not yet used as a decode input."""
    sampling_ids: dict[int, list[str]] = field(default_factory=dict)
    """Stage 0, async: per step, the requests that sample, in batch order."""
    registered_at: dict[str, int] = field(default_factory=dict)
    """Stage 0: the step a request was last sent whole (older tokens are stale)."""
    last_end_ns: int = 0
    """When this stage's last step ended (its next plan's wait counts from)."""
    last_step_ns: int = 0
    """How long its last step with requests took (start of its compute to its end)."""


class Timeline:
    """Per-step records of a stage and its busy / bubble fractions."""

    def __init__(self) -> None:
        self.records: deque[StepRecord] = deque(maxlen=_MAX_TIMELINE)

    def add(self, record: StepRecord) -> None:
        self.records.append(record)

    def clear(self) -> None:
        self.records.clear()

    def fractions(self) -> tuple[float, float, float]:
        """(busy, bubble, plan wait) over the steps recorded, excluding idle gaps with no
        work; plan wait is the part of the bubble this stage waited for plans."""
        records = list(self.records)
        if len(records) < 2:
            return 0.0, 0.0, 0.0
        busy = sum(r.end_ns - r.start_ns for r in records)
        wall = records[0].end_ns - records[0].start_ns
        plan_wait = 0
        for prev, cur in zip(records, records[1:], strict=False):
            gap = cur.start_ns - prev.end_ns
            if gap < _IDLE_GAP_NS:
                wall += gap
                plan_wait += min(cur.plan_wait_ns, gap)
            wall += cur.end_ns - cur.start_ns
        if not wall:
            return 0.0, 1.0, 0.0
        return busy / wall, 1.0 - busy / wall, plan_wait / wall


class StageEngine:
    """Executes plans of one pipeline session, in order, on one compute thread.

    `transport` is a `StageTransport` in a worker; any `Transport` works (tests run every
    stage of a pipeline in one process over an in-memory one).
    """

    def __init__(self, runner: StageRunner, transport: Transport) -> None:
        self.runner = runner
        self.transport = transport
        self._hidden_size = runner.model.config.hidden_size
        self._dtype = next(runner.model.parameters()).dtype
        self.timeline = Timeline()
        self._session: _Session | None = None
        self._runner_lock = threading.Lock()
        self.computing_since: float | None = None
        """`time.monotonic()` when the step computing now began; None between steps (the
        worker's hang watchdog reads it, server.py)."""

    @property
    def stage(self) -> int:
        return self.transport.stage

    @property
    def num_stages(self) -> int:
        return self.transport.num_stages

    @property
    def name(self) -> str:
        """ "stage S", or "stage S tp rank R" in a tensor-parallel stage (error messages)."""
        tp_size = getattr(self.transport, "tp_size", 1)
        if tp_size == 1:
            return f"stage {self.stage}"
        return f"stage {self.stage} tp rank {self.transport.tp_rank}"

    def start(
        self,
        on_outcome: Callable[[StepOutcome], None],
        epoch: int = 0,
        on_joined: Callable[[str | None], None] | None = None,
    ) -> None:
        """Starts a session: joins the pipeline group (rendezvous keys of `epoch`) on a
        fresh compute thread, which then calls `on_joined` with None, or with why it could
        not join. A previous session is stopped first."""
        if self._session is not None:
            self.stop()
        session = _Session(queue.Queue(), on_outcome, epoch, on_joined)
        session.thread = threading.Thread(
            target=self._loop, args=(session,), name=f"stage{self.stage}", daemon=True
        )
        self._session = session
        _session_threads.add(session.thread)
        session.thread.start()

    def between_steps(self, action: Callable[[], None]) -> None:
        """Runs `action` while no step computes (e.g. swapping weights in)."""
        with self._runner_lock:
            action()

    def submit(self, plan: StepPlan, tokens_from_last_stage: bool) -> None:
        self._session.plans.put((plan, tokens_from_last_stage, time.time_ns()))

    def stop(self, join_timeout_s: float = 5.0) -> None:
        """Ends the session: plans not started are dropped and the compute thread joined.

        A thread stuck waiting for a dead peer is abandoned: its wait fails when the
        peer's socket closes (or at the transport timeout), and it then finds itself
        stale and exits without touching the runner, which the next session owns. A thread
        still in the rendezvous is not waited for at all: it holds nothing of the runner's,
        the next session joins under other keys, and a peer that died mid-rendezvous would
        otherwise hold the next session up for the whole `join_timeout_s`.
        """
        session, self._session = self._session, None
        if session is None:
            return
        session.is_stale = True
        with contextlib.suppress(queue.Empty):
            while True:
                session.plans.get_nowait()
        session.plans.put(None)
        if session.joining:
            logger.info("stage %d: leaving an ended session's rendezvous to its thread", self.stage)
            return
        session.thread.join(join_timeout_s)
        if session.thread.is_alive():
            logger.warning("stage %d: abandoning a session stuck in a peer wait", self.stage)

    # ----------------------------------------------------------------- compute thread
    def _loop(self, session: _Session) -> None:
        try:
            session.link = self.transport.connect(session.epoch)
        except Exception as exc:  # noqa: BLE001 - reported to the scheduler
            if session.is_stale:  # ended while joining: a stage died, or none could meet
                logger.warning("stage %d: an ended session's join failed: %s", self.stage, exc)
                return
            logger.exception("stage %d could not join the pipeline", self.stage)
            session.broken = f"{self.name} could not join the pipeline: {exc}"
        finally:
            session.joining = False
        with self._runner_lock:
            if not session.is_stale:
                self.runner.requests.clear()  # a new session starts from no request
                tp = getattr(self.runner.model, "tp", None)
                if tp is not None and session.link is not None:
                    # the stage's collectives run on this session's group from now on
                    tp.group = getattr(session.link, "tp_group", None)
        if session.on_joined is not None and not session.is_stale:  # else nobody waits
            session.on_joined(session.broken)
        ready: deque = deque()  # plans taken off the queue (receives posted), not yet run
        while True:
            item = ready.popleft() if ready else self._take(session, session.plans.get())
            if item is None or session.is_stale:
                return
            with contextlib.suppress(queue.Empty):
                while len(ready) < _RECEIVES_AHEAD:
                    ready.append(self._take(session, session.plans.get_nowait()))
            plan, tokens_from_last_stage, arrived_ns = item
            # free before the plan came: the control plane's share of the bubble
            plan_wait_ns = max(0, arrived_ns - session.last_end_ns) if session.last_end_ns else 0
            if session.broken:
                session.on_outcome(StepOutcome(plan.step_id, None, error=session.broken))
                continue
            try:
                outcome = self._execute(session, plan, tokens_from_last_stage, plan_wait_ns)
            except Exception as exc:  # noqa: BLE001 - the session is over; tell the scheduler
                if session.is_stale:
                    return
                logger.exception("stage %d failed at step %d", self.stage, plan.step_id)
                session.broken = f"{self.name} failed at step {plan.step_id}: {exc}"
                outcome = StepOutcome(plan.step_id, None, error=session.broken)
            if outcome is None:  # stale
                return
            record = outcome.record
            if record is not None:
                if plan.num_requests:
                    if tokens_from_last_stage and self.transport.is_first:
                        outcome.plan_wait_ns = self._reported_wait(session, record)
                    session.last_step_ns = record.end_ns - record.start_ns
                session.last_end_ns = record.end_ns
            session.on_outcome(outcome)

    @staticmethod
    def _reported_wait(session: _Session, record: StepRecord) -> int:
        """Stage 0's plan wait as the scheduler's window should hear of it: 0 when it was a
        sliver of a step, or when the step then waited for the last stage's tokens for half
        as long again (they came after the plan: with the plan there sooner, the step could
        not have started sooner)."""
        plan_wait = record.plan_wait_ns
        if plan_wait <= PLAN_WAIT_REPORTED * session.last_step_ns or 2 * record.wait_ns > plan_wait:
            return 0
        return plan_wait

    def _execute(
        self,
        session: _Session,
        plan: StepPlan,
        tokens_from_last_stage: bool,
        plan_wait_ns: int = 0,
    ) -> StepOutcome | None:
        link = session.link
        t_wait = time.time_ns()
        hidden_in, input_tokens = None, None
        takes_tokens = tokens_from_last_stage and self.num_stages > 1
        if self.transport.is_first:
            for request_id in plan.finished_request_ids:
                session.pending_tokens.pop(request_id, None)
                session.registered_at.pop(request_id, None)
            for new in plan.new_requests:
                session.pending_tokens.pop(new.request_id, None)
                session.registered_at[new.request_id] = plan.step_id
            if takes_tokens:
                self._receive_tokens(session, plan.step_id)
                input_tokens = self._take_inputs(session, plan)
        elif plan.num_requests:
            hidden_in = link.recv_hidden(plan.num_scheduled_tokens, self._hidden_size, self._dtype)
        with self._runner_lock:
            if session.is_stale:
                return None
            t_start = time.time_ns()
            tp = getattr(self.runner.model, "tp", None)
            comm_before = tp.comm_ns if tp is not None else 0
            self.computing_since = time.monotonic()
            try:
                out = self.runner.execute(plan, hidden_in=hidden_in, input_token_ids=input_tokens)
            finally:
                self.computing_since = None
            collective_ns = tp.comm_ns - comm_before if tp is not None else 0
            if self.transport.is_first and takes_tokens:
                ids = self._sampling_request_ids(plan)
                if ids:
                    session.sampling_ids[plan.step_id] = ids
                    link.expect_tokens(len(ids))  # the last stage sends them P steps on
        result = None
        if self.transport.is_last:
            result = out
            if takes_tokens and result.token_ids:
                # One token per sampling request, as stage 0 counts them: the last one a
                # speculative step yielded (its plan entry after the step carries them all).
                link.send_tokens(torch.tensor(result.last_tokens(), dtype=torch.int64))
        elif plan.num_requests:
            link.send_hidden(out)
        t_end = time.time_ns()
        record = StepRecord(
            plan.step_id,
            plan.num_requests,
            plan.num_scheduled_tokens,
            t_start,
            t_end,
            t_start - t_wait,
            collective_ns,
            plan_wait_ns,
        )
        if plan.num_requests:
            self.timeline.add(record)
        return StepOutcome(plan.step_id, record, result=result)

    def _take(self, session: _Session, item):
        """A queue item as it leaves the queue, in plan order: a later stage posts the
        receive of the plan's activations now, before the steps ahead of it compute."""
        if item is not None and not self.transport.is_first and not session.broken:
            plan = item[0]
            if plan.num_requests:
                session.link.expect_hidden(
                    plan.num_scheduled_tokens, self._hidden_size, self._dtype
                )
        return item

    def _sampling_request_ids(self, plan: StepPlan) -> list[str]:
        """Stage 0: the requests that sample this step, in the runner's batch order."""
        requests = self.runner.requests
        ids = []
        for entry in (*plan.new_requests, *plan.cached_requests):
            state = requests.get(entry.request_id)
            if state is not None and state.num_computed_tokens >= len(state.token_ids):
                ids.append(entry.request_id)
        return ids

    def _receive_tokens(self, session: _Session, step_id: int) -> None:
        """Stage 0, async: receives, in step order, the tokens of every step <= step_id - P."""
        last_needed = step_id - self.num_stages
        for step in sorted(s for s in session.sampling_ids if s <= last_needed):
            ids = session.sampling_ids.pop(step)
            tokens = session.link.recv_tokens(len(ids)).tolist()
            for request_id, token in zip(ids, tokens, strict=True):
                if session.registered_at.get(request_id, step + 1) <= step:
                    session.pending_tokens[request_id] = token

    @staticmethod
    def _take_inputs(session: _Session, plan: StepPlan) -> dict[str, int]:
        inputs = {}
        for cached in plan.cached_requests:
            token = session.pending_tokens.pop(cached.request_id, None)
            if token is not None:
                inputs[cached.request_id] = token
        return inputs

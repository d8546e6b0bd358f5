"""The step planner: which requests run in the next micro-batch, and what happens after.

A service drives it like this::

    scheduler = Scheduler(config, store)          # or Scheduler.recover(config, store)
    scheduler.add_request(request)                # any time; QueueFull / PromptTooLong
    plan = scheduler.schedule()                   # one StepPlan per global step id
    ... send plan to every stage; last stage returns StepResult(step_id, ...) ...
    deltas = scheduler.process_result(result)     # tokens appended, stop checks, Redis flush
    scheduler.abort_request(request_id)           # any time

Pipeline rules (DESIGN.md "Asynchronous scheduling"), with P = num_stages:

* a request that samples a token at step s is planned again at step s + P at the earliest;
  successive prefill chunks that sample nothing may go in consecutive steps;
* sync: it also waits until that token was processed (`process_result`), and its next plan
  carries the token (`CachedRequest.new_token_ids`);
* async: it is planned without waiting (at most one result outstanding), with a KV slot for
  the token stage 0 receives straight from the last stage. A request found finished late
  has its extra token discarded.

Speculative decoding (`config.speculative`, docs/speculative-decoding.md): a decoding
request whose k > 0 carries up to k tokens proposed from its own log; it is planned only
when no step of it is in flight (in both modes), and its plan then carries its inputs and
its true computed-token count, which rolls back the stages' positions of rejected drafts.

Poison requests: when a stage fails on a step, the step's requests become suspects
(`step_failed`). After the pipeline is whole again, each suspect runs alone first; one
that passes a step alone is cleared, one a stage fails on alone is FAILED with the
stage's message. So a request that breaks a stage is failed after one retry, and everyone
else is served.
"""

from __future__ import annotations

import enum
import itertools
import logging
from dataclasses import dataclass
from operator import itemgetter

from services.common.errors import (
    ConfigError,
    OutOfBlocks,
    PromptTooLong,
    QueueFull,
    RequestExists,
    UnknownRequest,
)
from services.common.step import CachedRequest, NewRequest, StepPlan, StepResult, TokenLogprobs
from services.scheduler.block_manager import BlockManager
from services.scheduler.config import SchedulerConfig, SchedulerPolicy
from services.scheduler.policy import make_policy
from services.scheduler.request import Request, RequestStatus
from services.scheduler.speculative import (
    SpecStats,
    next_num_tokens,
    propose_ngram,
    tail_recurs,
)
from services.scheduler.state import RequestUpdate, StateStore, TokenDelta
from services.scheduler.updates import StepOutputs

logger = logging.getLogger(__name__)


_WAITING = (RequestStatus.WAITING.value, RequestStatus.PREEMPTED.value)
_RUN_SEQ = itemgetter(0)
MAX_PROBE_BACKOFF = 3
"""A request whose speculation keeps failing probes every 16, 32, 64, then 128 tokens
(`probe_interval` doubled each time, up to 2 ** this)."""


class PauseMode(str, enum.Enum):
    """How a paused scheduler treats running requests (queued ones always stay queued)."""

    WAIT = "wait"
    """Admit nothing new; running requests run to their end."""
    KEEP = "keep"
    """Plan nothing: running requests stay where they are, their KV kept."""
    ABORT = "abort"
    """Running requests are aborted (by the service); then as KEEP."""


_Run = tuple[Request, list[int], list[TokenLogprobs | None]]
"""A request's tokens in a step's result, and their logprobs (`StepResult.runs`)."""


@dataclass(slots=True)
class _Budget:
    num_tokens: int
    num_seqs: int


class Scheduler:
    """Owns the request queue, the running set and the KV block pool."""

    def __init__(self, config: SchedulerConfig, store: StateStore | None = None):
        if not config.is_resolved:
            raise ConfigError(
                "the planner needs num_blocks, block_size, max_model_len and "
                "max_num_batched_tokens: resolve the config against the workers first"
            )
        self.config = config
        self.block_manager = BlockManager(
            config.num_blocks, config.block_size, config.enable_prefix_caching
        )
        self.policy = make_policy(config.policy.value)
        self.requests: dict[str, Request] = {}
        """Every unfinished request, waiting or running."""
        self.running: dict[str, Request] = {}
        # Who is due, so that a plan looks at the requests that may run in it rather than
        # at every running one (at P = 8 a step takes 1 in 8): each running request is in
        # `_ready` (it may run now; left out of an earlier plan) or in `_due_at[s]` (it may
        # run from step s on), as (run_seq, request); an entry whose request has left
        # `running` since (finished, preempted) is dropped when taken.
        self._ready: list[tuple[int, Request]] = []
        self._due_at: dict[int, list[tuple[int, Request]]] = {}
        self._run_seqs = itertools.count()
        self._prefilling: set[str] = set()
        """Running requests with more than their last prompt token still to compute."""
        self.outputs = StepOutputs(store)
        self.outputs.live_requests = self.requests.values
        self.num_preemptions = 0
        self._next_step_id = 0
        self._finished_ids: list[str] = []
        self._charge = self.policy.charge if config.policy is SchedulerPolicy.FAIR else None
        self.suspects: dict[str, str] = {}
        """Requests that were in a step a stage failed on (in order), with the stage's
        message: the first runs alone until it passes a step or fails."""
        self._isolated_since: int | None = None
        """The step the first suspect first ran alone in."""
        self.num_poisoned = 0
        """Requests failed because a stage failed on them alone."""
        self.pause_mode: PauseMode | None = None
        """Set while paused: WAIT plans running requests only, KEEP and ABORT nothing."""
        self.spec_stats = SpecStats()
        """Speculative steps of every request so far (`conveyor stats`)."""
        self._draft_proposals: dict[str, list[int]] = {}
        """The draft worker's tokens for the step being planned (`schedule`)."""

    @classmethod
    def recover(cls, config: SchedulerConfig, store: StateStore) -> Scheduler:
        """A scheduler whose queue holds every unfinished request found in `store`: each
        comes back WAITING with prompt + outputs so far, to be recomputed."""
        scheduler = cls(config, store)
        for request in store.load_unfinished():
            scheduler.readmit(request)
        logger.info("recovered %d unfinished requests", len(scheduler.requests))
        return scheduler

    def readmit(self, request: Request) -> None:
        """Queue a request read back from the store (recovered after a restart, or adopted
        from a lost pipeline): WAITING, to be recomputed from its prompt and outputs so far.
        One already here is left alone."""
        if request.request_id in self.requests:
            return
        self.requests[request.request_id] = request
        self.policy.add(request)
        self.outputs.record_state(request)
        finished = request.check_stop(self.config.max_model_len)
        if finished is not None:  # its last token was logged just before the restart
            self._finish(request, finished)

    def release(self, request_id: str) -> Request | None:
        """Drop a request another pipeline adopted (its blocks freed, the workers told);
        the store refuses this scheduler's writes to it, so the abort recorded is not
        persisted. Returns it, or None when it is not here."""
        request = self.requests.get(request_id)
        if request is not None:
            self._finish(request, RequestStatus.FINISHED_ABORTED)
        return request

    # -- requests in and out ---------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a new request (persisted first). Raises `QueueFull`, `PromptTooLong`,
        `RequestExists`, or `StateStoreError` (then nothing is queued)."""
        cfg = self.config
        if request.request_id in self.requests:
            raise RequestExists(
                f"request id {request.request_id} is already in use: pick a unique id, or "
                "Resume it to follow its stream"
            )
        if self.outputs.has_pending(request.request_id):
            raise RequestExists(
                f"request id {request.request_id} belongs to a request whose last tokens are "
                "not persisted yet: pick a unique id, or retry in a moment"
            )
        if request.num_tokens >= cfg.max_model_len:
            raise PromptTooLong(
                f"request {request.request_id}: prompt of {request.num_tokens} tokens leaves "
                f"no room to generate under max_model_len={cfg.max_model_len}"
            )
        if len(self.policy) >= cfg.max_waiting:
            raise QueueFull(
                f"{len(self.policy)} requests are waiting (max_waiting={cfg.max_waiting}): "
                "retry later or add capacity"
            )
        self.outputs.persist_new(request)
        self.requests[request.request_id] = request
        self.policy.add(request)

    def abort_request(self, request_id: str) -> None:
        """Finish a request as aborted, wherever it is; its blocks are freed now and the
        workers drop it at the next plan. Raises `UnknownRequest` if it is not unfinished."""
        request = self.requests.get(request_id)
        if request is None:
            raise UnknownRequest(f"request {request_id} is not running or waiting here")
        self._finish(request, RequestStatus.FINISHED_ABORTED)

    def fail_request(self, request_id: str, reason: str) -> None:
        """Finish a request as FAILED with a reason (e.g. a worker rejected it)."""
        request = self.requests.get(request_id)
        if request is None:
            raise UnknownRequest(f"request {request_id} is not running or waiting here")
        self._finish(request, RequestStatus.FAILED, reason)

    def step_failed(self, request_ids: list[str], reason: str) -> list[Request]:
        """A stage failed on a step holding `request_ids` (call before `requeue_running`).
        Returns the requests failed now: the suspect running alone, if the step was its."""
        isolated = self.isolated_id
        if isolated is not None and self._isolated_since is not None and request_ids == [isolated]:
            request = self.requests[isolated]
            self.fail_request(isolated, f"a pipeline stage failed on this request: {reason}")
            self.num_poisoned += 1
            return [request]
        for request_id in request_ids:
            if request_id in self.requests:
                self.suspects.setdefault(request_id, reason)
        self._isolated_since = None
        return []

    def skip_to_next_ready(self, empty_step_id: int) -> bool:
        """Async mode, after an empty plan at step `empty_step_id`: if a running request
        waits only for the pipeline rule (it may run again at step s + P), jumps the step
        counter to the first later step one of them may run at, so that step is planned
        now — while step s is still in the stages — rather than after s reports. With one
        micro-batch (few requests) this keeps the scheduler's round trip off the critical
        path. Not while a speculating request's step is in flight: its report comes, and
        its next step takes the next consecutive id (`_decode_limits`). Returns whether
        it jumped."""
        if not self.config.is_async or self.is_frozen:
            return False
        if self.config.speculative is not None and any(
            r.pending_step_ids and self._speculates(r) for r in self.running.values()
        ):
            return False
        ready = [
            r.next_step_id
            for r in self.running.values()
            if r.status is RequestStatus.RUNNING
            and len(r.pending_step_ids) <= self._max_pending(r, 1)
            and r.next_step_id > empty_step_id
        ]
        if not ready:
            return False
        self._next_step_id = min(ready)
        return True

    @property
    def is_frozen(self) -> bool:
        """Paused so that nothing is planned (KEEP, ABORT)."""
        return self.pause_mode is PauseMode.KEEP or self.pause_mode is PauseMode.ABORT

    @property
    def isolated_id(self) -> str | None:
        """The suspect that runs alone now, or None."""
        return next(iter(self.suspects), None)

    @property
    def num_waiting(self) -> int:
        return len(self.policy)

    @property
    def next_step_id(self) -> int:
        """Global id the next `schedule()` gives its plan."""
        return self._next_step_id

    @property
    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # -- planning --------------------------------------------------------------------------
    def schedule(
        self, draft_proposals: dict[str, list[int]] | None = None, num_in_flight: int = 0
    ) -> StepPlan:
        """Plan the next global step: running decodes first, then prefill chunks. With
        speculation in async mode, a plan with nothing in it gives its step id back: the
        next plan takes it.

        `draft_proposals`: with a draft model, the draft worker's tokens for (some of) the
        requests `draft_candidates()` named; one without proposes nothing this step.
        `num_in_flight`: steps sent and not yet reported (speculating requests gather while
        the pipeline has enough to do, `_decode_limits`)."""
        self._draft_proposals = draft_proposals or {}
        step_id = self._next_step_id
        self._next_step_id += 1
        plan = StepPlan(step_id=step_id, finished_request_ids=self._finished_ids)
        self._finished_ids = []
        if self.is_frozen:  # paused: the plan only tells the workers what to forget
            return plan
        budget = _Budget(self.config.max_num_batched_tokens, self.config.max_num_seqs)
        is_async = self.config.is_async
        max_pending = 1 if is_async else 0
        max_model_len = self.config.max_model_len
        scheduled: set[str] = set()
        partial: list[Request] = []
        num_preempted = self.num_preemptions
        only = self.isolated_id
        limits = self._decode_limits(step_id, num_in_flight)
        due = self._take_due(step_id)

        # decode
        for _, request in due:
            if budget.num_seqs == 0:
                break
            if (
                (only is not None and request.request_id != only)
                or len(request.pending_step_ids) > self._max_pending(request, max_pending)
                or request.status is not RequestStatus.RUNNING
            ):
                continue
            num_known = request.num_tokens + (len(request.pending_step_ids) if is_async else 0)
            remaining = num_known - request.num_computed_tokens
            if remaining > 1:
                partial.append(request)
            elif remaining == 1 and budget.num_tokens > 0:
                # Never plan a token the request cannot keep (max_tokens, max_model_len).
                num_pending = len(request.pending_step_ids)
                if (
                    request.num_output_tokens + num_pending < request.sampling.max_tokens
                    and num_known < max_model_len
                ):
                    speculates = self._speculates(request)
                    if limits is not None:
                        if not limits[1] or (speculates and not limits[0]):
                            continue  # it goes in the next step, or gathers
                        limits[0] -= speculates
                        limits[1] -= 1
                    drafts = self._propose(request, budget) if speculates else []
                    self._schedule_cached(plan, request, 1, num_known, budget, scheduled, drafts)

        # prefill: chunks of prompts already running, then new (or resumed) requests
        for request in partial:
            if budget.num_tokens == 0 or budget.num_seqs == 0:
                break
            if request.status is not RequestStatus.RUNNING or (
                only is not None and request.request_id != only
            ):
                continue  # preempted to make room for an earlier one, or not the suspect
            num_known = request.num_tokens + (len(request.pending_step_ids) if is_async else 0)
            num_new = self._chunk(num_known - request.num_computed_tokens, budget.num_tokens)
            if num_new:
                self._schedule_cached(plan, request, num_new, num_known, budget, scheduled)
        self._ready = [entry for entry in due if entry[1].request_id not in scheduled]
        if self.num_preemptions == num_preempted and self.pause_mode is None:
            self._schedule_waiting(plan, budget, only)
        if only is not None and self._isolated_since is None and plan.num_requests:
            self._isolated_since = step_id
        is_empty = not plan.num_requests and not plan.finished_request_ids
        if is_empty and limits is not None and self.config.speculative is not None:
            self._next_step_id = step_id  # consecutive ids: see `_decode_limits`
        return plan

    def _take_due(self, step_id: int) -> list[tuple[int, Request]]:
        """The running requests the pipeline rule lets run at `step_id` (next_step_id <=
        step_id), in the order they began running, as (run_seq, request)."""
        due = self._ready
        for at in [at for at in self._due_at if at <= step_id]:
            due += self._due_at.pop(at)
        due = [e for e in due if e[0] == e[1].run_seq and e[1].status is RequestStatus.RUNNING]
        due.sort(key=_RUN_SEQ)  # a few sorted runs: linear
        return due

    def _num_decoding(self) -> int:
        """Running requests past their prompt (at most its last token still to compute)."""
        return len(self.running) - len(self._prefilling)

    # -- speculative decoding --------------------------------------------------------------
    def _speculates(self, request: Request) -> bool:
        """Whether the request proposes tokens now (its adaptive k > 0; a k of 0 comes
        back as 1 once the request decoded `probe_interval` tokens without)."""
        spec = self.config.speculative
        if spec is None:
            return False
        if request.num_spec_tokens is None:
            request.num_spec_tokens = spec.num_speculative_tokens
        if request.num_spec_tokens == 0 and request.num_output_tokens >= request.spec_resume_at:
            request.num_spec_tokens = 1
        return request.num_spec_tokens > 0

    def _decode_limits(self, step_id: int, num_in_flight: int) -> list[int] | None:
        """Async mode: the most [speculating, all] decodes the step at `step_id` may take
        (None: no limit), so that decodes run in P even micro-batches (D decoding
        requests, R of them speculating). A request runs again P steps after its last
        (the pipeline rule), so it keeps the lane its prefill ended in, and the token
        budget or max_num_seqs can leave lanes of 7 and 3: a step takes at most
        ceil(D / P) decodes, and one it leaves out runs in the next step, the other lane
        (docs/performance.md#even-micro-batches).

        With speculation (docs/speculative-decoding.md): a speculating request is
        planned only once its result is back, so groups that prefill admitted apart, or
        that return apart, would never meet, and a step costs much the same at a few
        requests as at several (the weights are read once per step). So a step also
        takes at most ceil(R / P) speculating decodes (a larger group is split over
        consecutive steps), and lanes stay even as requests start or stop speculating.
        Speculating requests that are back wait (limit 0) while they are fewer than
        R / P, at least P steps are in flight and one of those holds a smaller group to
        merge with; a few ordinary decodes wait for the next speculating step rather than
        run alone while speculating steps fly. Empty plans give their step ids back, so
        ids stay consecutive: stage 0 takes the tokens of every step <= t - P before step
        t, and a gap would make it wait for the step just before."""
        if not self.config.is_async:
            return None
        num_stages = self.config.num_stages
        if self.config.speculative is None:  # a hot path: only D is needed
            return [0, -(-self._num_decoding() // num_stages)]
        decoding = [
            r
            for r in self.running.values()
            if r.status is RequestStatus.RUNNING
            and r.num_computed_tokens >= r.num_prompt_tokens - 1
        ]
        total = -(-len(decoding) // num_stages)
        num_ready = num_speculating = num_others_ready = 0
        in_flight: dict[int, int] = {}  # step id -> speculating decodes in it
        for request in decoding:
            if not self._speculates(request):
                num_others_ready += (
                    len(request.pending_step_ids) <= 1 and request.next_step_id <= step_id
                )
                continue
            num_speculating += 1
            for pending in request.pending_step_ids:
                in_flight[pending] = in_flight.get(pending, 0) + 1
            if not request.pending_step_ids and request.next_step_id <= step_id:
                num_ready += 1
        quota = -(-num_speculating // num_stages)
        if (
            num_ready < quota
            and num_in_flight >= num_stages
            and any(n < quota for n in in_flight.values())
        ):
            quota = 0
        if (not quota or not num_ready) and in_flight and 2 * num_others_ready < total:
            total = 0  # a few others alone: they join the next speculating group instead
        return [quota, total]

    def _max_pending(self, request: Request, max_pending: int) -> int:
        """Results a request may have outstanding when planned: none while it speculates
        (the proposer needs its newest tokens, the plan its true position)."""
        if request.spec_token_ids or self._speculates(request):
            return 0
        return max_pending

    def draft_candidates(self, num_in_flight: int = 0) -> list[tuple[Request, int]]:
        """Draft model: the requests the next `schedule(..., num_in_flight)` may propose
        tokens for, each with the most tokens it can keep; the draft worker's tokens for
        them go to `schedule`. Only requests with nothing in flight (their tokens are all
        known) are named, and no more than the step takes (`_decode_limits`)."""
        spec = self.config.speculative
        if spec is None or not spec.uses_draft_model or self.is_frozen:
            return []
        step_id, only = self._next_step_id, self.isolated_id
        limits = self._decode_limits(step_id, num_in_flight)
        quota = None if limits is None else min(limits)
        candidates = []
        for request in self.running.values():
            if quota == 0:
                break
            if (
                request.status is not RequestStatus.RUNNING
                or request.pending_step_ids
                or request.next_step_id > step_id
                or (only is not None and request.request_id != only)
                or request.num_tokens - request.num_computed_tokens != 1
                or not self._speculates(request)
            ):
                continue
            if quota is not None:
                quota -= 1
            room = self._room(request, self.config.max_num_batched_tokens)
            if room > 0:
                candidates.append((request, room))
        return candidates

    def _room(self, request: Request, num_budget_tokens: int) -> int:
        """Proposed tokens the request can keep: k, max_tokens, max_model_len, the budget."""
        return min(
            request.num_spec_tokens,
            request.sampling.max_tokens - request.num_output_tokens - 1,
            self.config.max_model_len - request.num_tokens - 1,
            num_budget_tokens - 1,
        )

    def _propose(self, request: Request, budget: _Budget) -> list[int]:
        """Up to k proposed tokens the request can keep (max_tokens, max_model_len, the
        step's token budget); none found halves k. A draft model's request the draft worker
        did not answer for (down, slow) proposes nothing and keeps its k."""
        spec = self.config.speculative
        room = self._room(request, budget.num_tokens)
        if room <= 0:
            return []
        if spec.uses_draft_model:
            drafts = self._draft_proposals.get(request.request_id)
            if drafts is None:
                return []
            drafts = drafts[:room]
        else:
            drafts = propose_ngram(
                request.token_ids, room, spec.prompt_lookup_max, spec.prompt_lookup_min
            )
        if not drafts:
            self._adapt(request, 0, 0)
        return drafts

    def _adapt(self, request: Request, num_drafts: int, num_accepted: int) -> None:
        spec = self.config.speculative
        k = next_num_tokens(
            request.num_spec_tokens, num_drafts, num_accepted, spec.num_speculative_tokens
        )
        if k == 0 and request.num_spec_tokens:  # probe again later, later each time
            wait = spec.probe_interval << request.spec_backoff
            request.spec_paused_at = request.num_output_tokens
            request.spec_resume_at = request.num_output_tokens + wait
            request.spec_backoff = min(request.spec_backoff + 1, MAX_PROBE_BACKOFF)
        elif k > request.num_spec_tokens:
            request.spec_backoff = 0
        request.num_spec_tokens = k

    def _probe_early(self, request: Request) -> None:
        """N-gram: a request waiting for its next probe (k = 0) speculates again at once
        when its newest token repeats what came before (`tail_recurs`: prompt lookup would
        have proposed it), rather than `probe_interval` or more tokens later, and with k =
        half the most: a text that starts repeating itself after a few tokens of its own
        (a "repeat this" answer's preamble) speculates from there, and text that never
        repeats never probes early."""
        spec = self.config.speculative
        if (
            spec is None
            or spec.uses_draft_model
            or request.num_spec_tokens != 0
            or request.num_output_tokens >= request.spec_resume_at
        ):
            return
        length = spec.prompt_lookup_max + 1  # a longest lookup and the token it proposes
        if request.num_output_tokens - request.spec_paused_at < length:
            return  # the last probe already saw (some of) these tokens
        if tail_recurs(request.token_ids, length, request.packed_token_ids):
            # a lookup matched: start at half the most k rather than at the probe's 1
            request.num_spec_tokens = max(1, spec.num_speculative_tokens // 2)

    def _chunk(self, num_remaining: int, num_budget: int) -> int:
        if num_remaining <= num_budget:
            return num_remaining
        return num_budget if self.config.enable_chunked_prefill else 0

    def _schedule_cached(
        self,
        plan: StepPlan,
        request: Request,
        num_new: int,
        num_known: int,
        budget: _Budget,
        scheduled: set[str],
        drafts: list[int] | None = None,
    ) -> None:
        bm = self.block_manager
        num_slots = request.num_computed_tokens + num_new
        if drafts and not bm.can_allocate(request.request_id, num_slots + len(drafts)):
            drafts = []  # proposed tokens never preempt anyone
        drafts = drafts or []
        num_slots += len(drafts)  # the drafts' KV goes where their tokens would
        try:
            new_block_ids = bm.allocate(request.request_id, num_slots)
        except OutOfBlocks:
            if not self._make_room(request, num_slots, scheduled, plan):
                return
            new_block_ids = bm.allocate(request.request_id, num_slots)
        is_synced = self.config.speculative is not None and not request.pending_step_ids
        new_token_ids: list[int] = []
        if (not self.config.is_async or is_synced) and (
            request.num_tokens_on_workers != request.num_tokens
        ):
            new_token_ids = request.token_ids[request.num_tokens_on_workers :]
            request.num_tokens_on_workers = request.num_tokens
        elif self.config.is_async:  # stage 0 places the forwarded input: it knows this many
            request.num_tokens_on_workers = max(
                request.num_tokens_on_workers, request.num_computed_tokens + num_new
            )
        plan.cached_requests.append(
            CachedRequest(
                request.request_id,
                num_new,
                new_block_ids,
                new_token_ids,
                spec_token_ids=drafts,
                # Nothing in flight: the count is exact, and rolls back a speculative step's
                # rejected positions on the stages that could not tell.
                num_computed_tokens=request.num_computed_tokens if is_synced else None,
            )
        )
        request.spec_token_ids = drafts
        budget.num_tokens -= len(drafts)
        self._after_scheduled(plan.step_id, request, num_new, num_known, budget, scheduled)

    def _schedule_waiting(self, plan: StepPlan, budget: _Budget, only: str | None) -> None:
        """Admits requests from the head of the queue; with `only` (a suspect running
        alone), that one if it waits and the plan is empty, and no other."""
        bm = self.block_manager
        step_id = plan.step_id
        while budget.num_tokens > 0 and budget.num_seqs > 0:
            request = self.policy.peek() if only is None else self._waiting_suspect(only, plan)
            if request is None or request.next_step_id > step_id:
                break  # a preempted request waits out its in-flight step, like any other
            prefix = bm.find_cached_prefix(request.token_ids, request.extra_key)
            num_cached = prefix.num_tokens(bm.block_size)
            num_new = self._chunk(request.num_tokens - num_cached, budget.num_tokens)
            if num_new == 0 or not bm.can_allocate(
                request.request_id, num_cached + num_new, prefix
            ):
                break
            if only is None:
                self.policy.pop()
            else:
                self.policy.remove(request)
            block_ids = bm.allocate(
                request.request_id, num_cached + num_new, prefix, request.extra_key
            )
            request.transition(RequestStatus.RUNNING)
            self.outputs.record_state(request)
            if request.num_cached_tokens is None:
                request.num_cached_tokens = min(num_cached, request.num_prompt_tokens)
            request.num_computed_tokens = num_cached
            request.num_tokens_on_workers = request.num_tokens
            plan.new_requests.append(
                NewRequest(
                    request_id=request.request_id,
                    token_ids=list(request.token_ids),
                    num_prompt_tokens=request.num_prompt_tokens,
                    sampling=request.sampling,
                    block_ids=block_ids,
                    num_computed_tokens=num_cached,
                    num_scheduled_tokens=num_new,
                )
            )
            self.running[request.request_id] = request
            request.run_seq = next(self._run_seqs)
            self._after_scheduled(plan.step_id, request, num_new, request.num_tokens, budget, set())

    def _waiting_suspect(self, request_id: str, plan: StepPlan) -> Request | None:
        request = self.requests.get(request_id)
        if plan.num_requests or request is None or request.status.value not in _WAITING:
            return None
        return request

    def _after_scheduled(
        self,
        step_id: int,
        request: Request,
        num_new: int,
        num_known: int,
        budget: _Budget,
        scheduled: set[str],
    ) -> None:
        request.num_computed_tokens += num_new
        budget.num_tokens -= num_new
        budget.num_seqs -= 1
        scheduled.add(request.request_id)
        if request.num_computed_tokens == num_known:  # this step samples a token
            request.pending_step_ids.append(step_id)
            request.next_step_id = step_id + self.config.num_stages
        else:
            request.next_step_id = step_id + 1
        self._due_at.setdefault(request.next_step_id, []).append((request.run_seq, request))
        if request.num_computed_tokens < request.num_prompt_tokens - 1:
            self._prefilling.add(request.request_id)
        else:
            self._prefilling.discard(request.request_id)
        # Hash only when a block filled up (async decodes hash it one block later, once its
        # tokens are all known): no per-token work on the decode path.
        if num_new > 1 or request.num_computed_tokens % self.config.block_size == 0:
            self.block_manager.cache_full_blocks(
                request.request_id, request.token_ids, request.num_computed_tokens
            )
        if self._charge is not None:
            self._charge(request, num_new)

    # -- preemption ------------------------------------------------------------------------
    def _make_room(
        self, request: Request, num_slots: int, scheduled: set[str], plan: StepPlan
    ) -> bool:
        """Preempt until `request` can grow to `num_slots`; False if it was preempted itself."""
        while not self.block_manager.can_allocate(request.request_id, num_slots):
            victim = max(
                (r for r in self.running.values() if r.request_id not in scheduled),
                key=lambda r: (r.priority, r.arrival_time),
            )
            self._preempt(victim, plan.finished_request_ids)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request, finished_ids: list[str]) -> None:
        """Free the request's blocks and put it back at the front of the queue; it will be
        recomputed from prompt + outputs so far. Workers drop it with the plan whose
        `finished_request_ids` is `finished_ids`."""
        logger.debug("preempting %s", request.request_id)
        self.block_manager.free(request.request_id)
        request.transition(RequestStatus.PREEMPTED)
        self.outputs.record_state(request)
        self._forget_on_workers(request, finished_ids)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        del self.running[request.request_id]
        self._prefilling.discard(request.request_id)
        self.policy.requeue(request)

    def recompute_running(self) -> int:
        """Preempts every running request, to be recomputed from its tokens so far (after a
        weight update, when its KV came from the old weights); call with nothing in flight.
        Returns how many."""
        requests = list(self.running.values())
        for request in reversed(requests):  # the oldest ends up in front
            self._preempt(request, self._finished_ids)
        return len(requests)

    def requeue_running(self) -> None:
        """The pipeline was lost (a stage died): every running request goes back to the front
        of the queue, to be recomputed from prompt + outputs so far on fresh workers. Their
        KV is gone, so the prefix cache is emptied too; results of in-flight steps are
        discarded when they arrive late."""
        for request in reversed(list(self.running.values())):  # oldest ends up in front
            self.block_manager.free(request.request_id)
            request.transition(RequestStatus.PREEMPTED)
            self.outputs.record_state(request)
            request.pending_step_ids.clear()
            request.spec_token_ids = []
            request.num_tokens_on_workers = None
            request.num_computed_tokens = 0
            request.next_step_id = 0  # no step of the lost session is in flight any more
            self.policy.requeue(request)
        self.running.clear()
        self._ready, self._due_at = [], {}
        self._prefilling.clear()
        self._finished_ids = []  # fresh workers hold nothing to drop
        self.block_manager.reset_prefix_cache()
        logger.info("re-queued every running request after a pipeline loss")

    def _forget_on_workers(self, request: Request, finished_ids: list[str]) -> None:
        request.pending_step_ids.clear()  # results of in-flight steps are discarded
        request.spec_token_ids = []
        if request.num_tokens_on_workers is not None:
            finished_ids.append(request.request_id)
            request.num_tokens_on_workers = None

    def _finish(self, request: Request, status: RequestStatus, reason: str | None = None) -> None:
        if self.suspects.pop(request.request_id, None) is not None:
            self._isolated_since = None
        if request.status is RequestStatus.WAITING or request.status is RequestStatus.PREEMPTED:
            self.policy.remove(request)
        request.transition(status, reason)
        self.outputs.record_state(request)
        self.block_manager.free(request.request_id)
        self._forget_on_workers(request, self._finished_ids)
        self.running.pop(request.request_id, None)
        self._prefilling.discard(request.request_id)
        del self.requests[request.request_id]

    # -- results ---------------------------------------------------------------------------
    def process_result(self, result: StepResult) -> list[TokenDelta]:
        """Append the sampled tokens of one step, finish requests that hit a stop condition,
        persist the step in one store round trip, and return the deltas to stream.

        Tokens of requests that finished or were preempted since the step was planned are
        discarded. Raises `StateStoreError` if the store is down; the writes and deltas are
        kept and go out with the next successful call.
        """
        self.apply_result(result)
        return self.outputs.flush()

    def apply_result(self, result: StepResult, runs: list[_Run] | None = None) -> None:
        """`process_result` without the flush: the step's writes and deltas stay buffered in
        `outputs` (the service applies every report that is waiting, then flushes once).
        `runs`: what `check_result(result)` returned, when the caller checked it already."""
        if runs is None:
            runs = self.check_result(result)
        step_id = result.step_id
        if self._isolated_since is not None and step_id >= self._isolated_since:
            self.suspects.pop(self.isolated_id, None)  # it passed a step alone: cleared
            self._isolated_since = None
        for request, token_ids, logprobs in runs:
            request_id = request.request_id
            request.pending_step_ids.pop(0)
            drafts, request.spec_token_ids = request.spec_token_ids, []
            num_accepted = len(token_ids) - 1  # their KV was computed with the step
            if drafts:
                request.spec.add(len(drafts), num_accepted)
                self.spec_stats.add(len(drafts), num_accepted)
                self._adapt(request, len(drafts), num_accepted)
            request.num_computed_tokens += num_accepted
            if self._charge is not None and num_accepted:
                self._charge(request, num_accepted)  # their tokens were computed too
            for token_id, lp in zip(token_ids, logprobs, strict=True):
                request.append_output(token_id)
                finished = request.check_stop(self.config.max_model_len)
                self.outputs.record_token(request, token_id, lp, finished)
                if finished is not None:  # tokens after a stop are dropped
                    self._finish(request, finished)
                    break
            else:
                if num_accepted:
                    self.block_manager.cache_full_blocks(
                        request_id, request.token_ids, request.num_computed_tokens
                    )
                elif not drafts:
                    self._probe_early(request)

    def _applies_to(self, request_id: str, step_id: int) -> Request | None:
        """The request a result of `step_id` is for, or None when it is to be discarded
        (finished, preempted, or re-planned since)."""
        request = self.requests.get(request_id)
        if request is None or request.status is not RequestStatus.RUNNING:
            return None
        if not request.pending_step_ids or request.pending_step_ids[0] != step_id:
            return None
        return request

    def check_result(self, result: StepResult) -> list[_Run]:
        """The result's runs that apply (`_applies_to`; the others are discarded), for
        `apply_result`; raises ValueError when a stage's result cannot be a result of a
        planned step."""
        num_logprobs = len(result.logprobs) if result.logprobs else len(result.request_ids)
        if not len(result.request_ids) == len(result.token_ids) == num_logprobs:
            raise ValueError(
                f"step {result.step_id} result is malformed: {len(result.request_ids)} request "
                f"ids, {len(result.token_ids)} tokens, {num_logprobs} logprobs (must be equal)"
            )
        if not 0 <= result.step_id < self._next_step_id:
            raise ValueError(f"step {result.step_id} was never planned")
        if any(not 0 <= t < 2**31 for t in result.token_ids):
            raise ValueError(f"step {result.step_id} result holds a token id out of range")
        runs = []
        for request_id, token_ids, logprobs in result.runs():
            request = self._applies_to(request_id, result.step_id)
            if request is None:
                logger.debug("discarding tokens of %s from step %d", request_id, result.step_id)
                continue
            drafts = request.spec_token_ids
            if len(token_ids) > len(drafts) + 1 or token_ids[:-1] != drafts[: len(token_ids) - 1]:
                raise ValueError(
                    f"step {result.step_id}: request {request_id} yielded {len(token_ids)} "
                    f"tokens for {len(drafts)} proposed: a step yields the accepted proposed "
                    "tokens and one more"
                )
            runs.append((request, token_ids, logprobs))
        return runs

    def updates_pending(self) -> list[RequestUpdate]:
        """State changes not yet persisted (for tests and diagnostics)."""
        return self.outputs.pending_updates()

"""One generation request as the scheduler sees it: its tokens, its state, its stop rules.

States (DESIGN.md "Request states")::

    WAITING ──▶ RUNNING ──▶ FINISHED_STOPPED | FINISHED_LENGTH
       ▲           │
       │           ▼
       └──── PREEMPTED ──▶ RUNNING   (resumed: recomputes prompt + outputs so far)

    any unfinished state ──▶ FINISHED_ABORTED | FAILED(reason)

PREEMPTED is a waiting state (the request sits at the front of the queue); a restarted
scheduler brings every unfinished request back as WAITING. `Request.transition` is the one
place a state changes; an illegal change raises `InvalidTransition`.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from services.common.errors import ConveyorError, InvalidRequest
from services.common.sampling import SamplingParams
from services.scheduler.speculative import SpecStats


class InvalidTransition(ConveyorError, RuntimeError):
    """A request was asked to move between two states that are not connected (a bug)."""


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"
    FAILED = "failed"

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        """OpenAI/vLLM-style finish reason (`stop`, `length`, `abort`, `error`), or None."""
        return _FINISH_REASONS.get(self)


_FINISHED = frozenset(
    {
        RequestStatus.FINISHED_STOPPED,
        RequestStatus.FINISHED_LENGTH,
        RequestStatus.FINISHED_ABORTED,
        RequestStatus.FAILED,
    }
)
_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FAILED: "error",
}
_ENDS = {RequestStatus.FINISHED_ABORTED, RequestStatus.FAILED}
_ALLOWED: dict[RequestStatus, set[RequestStatus]] = {
    # WAITING may finish by length/stop only when recovered with its final tokens already logged.
    RequestStatus.WAITING: {
        RequestStatus.RUNNING,
        RequestStatus.FINISHED_STOPPED,
        RequestStatus.FINISHED_LENGTH,
        *_ENDS,
    },
    RequestStatus.RUNNING: {
        RequestStatus.PREEMPTED,
        RequestStatus.FINISHED_STOPPED,
        RequestStatus.FINISHED_LENGTH,
        *_ENDS,
    },
    RequestStatus.PREEMPTED: {RequestStatus.RUNNING, RequestStatus.WAITING, *_ENDS},
}


@dataclass(slots=True, eq=False)
class Request:
    """A request with its prompt, outputs so far and the scheduler's bookkeeping.

    Identity equality (`eq=False`): two requests are the same only if they are one object.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    arrival_time: float = field(default_factory=time.time)
    """Wall-clock seconds at submission (kept across restarts; orders fcfs and ties)."""
    priority: int = 0
    """Lower runs first under the `priority` policy; also picks preemption victims."""
    tenant: str = "default"
    weight: float = 1.0
    """The tenant's share under the `fair` policy (2.0 gets twice the tokens of 1.0)."""
    eos_token_ids: tuple[int, ...] = ()
    """The model's EOS ids: any of them finishes the request (unless `ignore_eos`)."""
    extra_key: str | None = None
    """Namespace of the prefix cache (the tenant's salt, see `cache_salt`): equal prefixes
    with different keys never share blocks."""
    owner_token: str = field(default="", repr=False)
    """The secret its Submit carried: Resume and Abort must present it (ownership.py)."""
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    fail_reason: str | None = None

    # Scheduler bookkeeping, not part of the request's identity.
    token_ids: list[int] = field(init=False)
    """Prompt followed by outputs: the sequence whose KV the blocks hold."""
    num_computed_tokens: int = field(default=0, init=False)
    """Tokens whose KV is computed by steps already planned (may run one ahead of
    `token_ids` in async mode: the optimistic slot of a token not yet seen here)."""
    pending_step_ids: list[int] = field(default_factory=list, init=False)
    """Planned steps that sample a token for this request whose result is not processed."""
    next_step_id: int = field(default=0, init=False)
    """Earliest global step this request may be planned in (pipeline rule)."""
    run_seq: int = field(default=-1, init=False)
    """When it last began running, in the scheduler's admission count: the order in which
    running requests are planned (the planner's index of who is due, scheduler.py)."""
    num_tokens_on_workers: int | None = field(default=None, init=False)
    """Tokens the workers were sent (sync mode deltas); None while workers do not hold it."""
    num_preemptions: int = field(default=0, init=False)
    num_cached_tokens: int | None = field(default=None, init=False)
    """Prompt tokens found in the prefix cache when it was first scheduled (usage)."""
    num_spec_tokens: int | None = field(default=None, init=False)
    """Speculative decoding: how many tokens to propose next (adaptive k); None: not set."""
    spec_token_ids: list[int] = field(default_factory=list, init=False)
    """The tokens proposed in the step in flight (at most one speculative step is)."""
    spec_resume_at: int = field(default=0, init=False)
    """With k = 0: the output count at which the request proposes again (k = 1)."""
    spec_backoff: int = field(default=0, init=False)
    """Times in a row k fell to 0: each doubles the wait before the next probe."""
    spec_paused_at: int = field(default=0, init=False)
    """The output count when k last fell to 0 (an early probe waits for new tokens)."""
    packed_token_ids: bytearray = field(default_factory=bytearray, init=False, repr=False)
    """token_ids as int32 bytes, extended by the early probe's search (`tail_recurs`)."""
    spec: SpecStats = field(default_factory=SpecStats, init=False)

    def __post_init__(self) -> None:
        if not self.request_id:
            raise InvalidRequest("request_id is empty: give every request a unique id")
        if not self.prompt_token_ids:
            raise InvalidRequest(f"request {self.request_id}: the prompt has no tokens")
        if any(t < 0 for t in self.prompt_token_ids):
            raise InvalidRequest(f"request {self.request_id}: prompt token ids must be >= 0")
        if not self.weight > 0.0:
            raise InvalidRequest(f"request {self.request_id}: weight={self.weight} must be > 0")
        if not self.tenant:
            raise InvalidRequest(f"request {self.request_id}: tenant is empty")
        self.token_ids = [*self.prompt_token_ids, *self.output_token_ids]

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @staticmethod
    def cache_salt(tenant: str) -> str:
        """The prefix-cache namespace of a tenant: blocks are shared within it, never across
        tenants (a first token that comes back fast must not tell one tenant what another
        sent)."""
        return f"tenant:{tenant}"

    def transition(self, new_status: RequestStatus, reason: str | None = None) -> None:
        """Move to `new_status`; raise `InvalidTransition` when the two are not connected."""
        if new_status not in _ALLOWED.get(self.status, ()):
            raise InvalidTransition(
                f"request {self.request_id}: cannot go from {self.status.value} to "
                f"{new_status.value}"
            )
        self.status = new_status
        if new_status is RequestStatus.FAILED:
            self.fail_reason = reason or "unknown failure"

    def append_output(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.token_ids.append(token_id)

    def check_stop(self, max_model_len: int) -> RequestStatus | None:
        """The finished state the last output token puts this request in, or None."""
        # Before min_tokens the worker's sampler masks EOS and stop_token_ids out; checking
        # here as well keeps any worker (the simulated one) from ending the request early.
        if self.output_token_ids and self.num_output_tokens >= self.sampling.min_tokens:
            last = self.output_token_ids[-1]
            params = self.sampling
            if last in self.eos_token_ids and not params.ignore_eos:
                return RequestStatus.FINISHED_STOPPED
            if last in params.stop_token_ids:
                return RequestStatus.FINISHED_STOPPED
        if self.num_output_tokens >= self.sampling.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if self.num_tokens >= max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

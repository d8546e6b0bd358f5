"""Records the scheduler hands out and the interface of its state store.

Pure: the Redis implementation lives in `services/scheduler/store.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from services.common.step import TokenLogprobs
from services.scheduler.request import Request, RequestStatus


@dataclass(slots=True)
class TokenDelta:
    """New output tokens of one request, for streaming to the router."""

    request_id: str
    token_ids: list[int]
    offset: int
    """Index in the request's output of `token_ids[0]` (a resuming stream skips to it)."""
    finish_reason: str | None = None
    """`stop`, `length`, `abort` or `error` when this delta ends the request."""
    logprobs: list[TokenLogprobs | None] | None = None
    error: str | None = None
    """Why the request failed (finish reason `error`)."""
    num_cached_tokens: int = 0
    """Prompt tokens the request found in the prefix cache (usage.cached_tokens)."""
    num_prompt_tokens: int = 0
    """Set on a resume's first delta: a router that did not submit it learns the usage."""
    weight_version: int = 0
    """The weights serving the request when the delta was sent (UpdateWeights)."""
    owner_pipeline_id: str | None = None
    """Set when this scheduler does not run the request (any more): the pipeline that owns
    it, where the stream resumes. Such a delta ends the stream without a finish reason."""
    num_spec_steps: int = 0
    """Speculative decoding, the request's counts so far: steps with proposed tokens,"""
    num_spec_draft_tokens: int = 0
    """tokens proposed,"""
    num_spec_accepted_tokens: int = 0
    """and proposed tokens the model confirmed."""


@dataclass(slots=True)
class RequestUpdate:
    """Everything that changed for one request since the last flush to the store."""

    request_id: str
    status: RequestStatus | None = None
    """New state, or None when only tokens were appended."""
    reason: str | None = None
    offset: int = 0
    """Output index of `token_ids[0]`: the store appends only tokens it does not have."""
    token_ids: list[int] = field(default_factory=list)


class StateStore(Protocol):
    """Where request state survives a scheduler restart (Redis in production)."""

    round_trips: int

    def add(self, request: Request) -> None:
        """Persist a new request (prompt, params, tenant, priority) before it is queued."""

    def apply(self, updates: list[RequestUpdate]) -> set[str]:
        """Persist one step's state changes and appended tokens in one round trip.
        Idempotent: applying the same updates twice appends nothing twice. Returns the
        requests whose writes were refused because another pipeline owns them now (their
        tokens must not be streamed: the new owner recomputes them)."""

    def check(self) -> None:
        """Raises `StateStoreError` when the store does not answer, `StoreLost` when it lost
        what was written to it (checked every second even while nothing else is written)."""

    def rewrite(self, requests: list[Request]) -> None:
        """Write these requests whole after the store lost state (`StoreLost`), and close the
        unfinished requests it lists that are not among them."""

    def load_unfinished(self) -> list[Request]:
        """Every unfinished request, WAITING, with prompt and outputs so far, oldest first."""

    def read_state(self, request_id: str) -> RequestStatus | None:
        """A request's state, finished ones too until they expire; None when unknown."""

    def read_tokens(self, request_id: str, offset: int = 0) -> list[int]:
        """A request's output tokens from `offset` on (a broken stream resumes there)."""

    def read_owner_pipeline(self, request_id: str) -> str | None:
        """The pipeline that owns a request ("" for a lone one); None when unknown."""

    def read_owners(self, request_ids: list[str]) -> dict[str, str | None]:
        """The owning pipeline of each request (None when unknown)."""

    def take_moved(self) -> set[str]:
        """Requests whose writes were refused since the last call (another pipeline adopted
        them)."""

    def load_requests(self, ids: list[str]) -> list[Request]:
        """These requests as `load_unfinished` returns them (finished ones dropped)."""

    def read_owner_token(self, request_id: str) -> str | None:
        """The owner token a request was submitted with ("" for one stored before owner
        tokens existed); None when the request is unknown or expired."""

    def read_prompt_len(self, request_id: str) -> int:
        """How many prompt tokens a request has (0 when unknown): a resume's usage."""

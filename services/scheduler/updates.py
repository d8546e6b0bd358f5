"""What one step changed: state writes for the store and token deltas for the router.

The scheduler records every state change and appended token here while it plans and
processes results; `flush()` sends them to the store in one round trip and returns the
deltas. If the store is down, both stay buffered (and merge with the next step's), so no
token is lost or streamed before it is persisted; the store's appends are offset-checked, so
a flush that half-reached Redis and is sent again appends nothing twice. If the store lost
state (`StoreLost`: Redis restarted empty or stale), every live request and every request
with a buffered change is written whole again from memory, the source of truth.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from services.common.errors import StoreLost
from services.common.step import TokenLogprobs
from services.scheduler.request import Request, RequestStatus
from services.scheduler.state import RequestUpdate, StateStore, TokenDelta

logger = logging.getLogger(__name__)


class StepOutputs:
    """Buffers one step's writes and deltas until `flush()`."""

    def __init__(self, store: StateStore | None):
        self.store = store
        self.live_requests: Callable[[], Iterable[Request]] = list
        """Every unfinished request (set by the scheduler): what a lost store is rewritten
        with."""
        self._updates: dict[str, RequestUpdate] = {}
        self._updated: dict[str, Request] = {}
        """The request behind each buffered update (a finished one is no longer live)."""
        self._deltas: dict[str, TokenDelta] = {}
        self.on_state: Callable[[Request], None] | None = None
        """Called after every state change (the scheduler's event trace, spans, metrics)."""

    def persist_new(self, request: Request) -> None:
        """Write a new request now (its own round trip): a submission is acknowledged only
        once it would survive a restart."""
        if self.store is not None:
            self.store.add(request)

    def record_state(self, request: Request) -> None:
        if self.on_state is not None:
            self.on_state(request)
        if self.store is None:
            return
        update = self._update(request)
        update.status = request.status
        update.reason = request.fail_reason

    def record_token(
        self,
        request: Request,
        token_id: int,
        logprobs: TokenLogprobs | None,
        finished: RequestStatus | None,
    ) -> None:
        """`token_id` was just appended to `request`'s output."""
        offset = request.num_output_tokens - 1
        if self.store is not None:
            update = self._update(request)
            if not update.token_ids:
                update.offset = offset
            update.token_ids.append(token_id)
        delta = self._deltas.get(request.request_id)
        if delta is None:
            delta = self._deltas[request.request_id] = TokenDelta(
                request.request_id,
                [],
                offset,
                logprobs=[],
                num_cached_tokens=request.num_cached_tokens or 0,
            )
        delta.token_ids.append(token_id)
        delta.logprobs.append(logprobs)
        spec = request.spec
        delta.num_spec_steps = spec.num_steps
        delta.num_spec_draft_tokens = spec.num_draft_tokens
        delta.num_spec_accepted_tokens = spec.num_accepted_tokens
        if finished is not None:
            delta.finish_reason = finished.finish_reason

    def flush(self) -> list[TokenDelta]:
        """Persist the buffered writes (one round trip) and hand out the buffered deltas.
        Raises `StateStoreError` and keeps both buffered when the store is down."""
        if self.store is not None and self._updates:
            try:
                self.store.apply(list(self._updates.values()))
            except StoreLost as exc:
                self.rewrite(exc)
            self._updates.clear()
            self._updated.clear()
        deltas = list(self._deltas.values())
        self._deltas.clear()
        for delta in deltas:
            if not any(delta.logprobs):
                delta.logprobs = None
        return deltas

    def rewrite(self, cause: StoreLost) -> None:
        """Writes every live request, and every one with a buffered change, whole again
        (the store lost state); the buffered changes are then in the store."""
        logger.warning("%s; writing every live request again", cause)
        requests = {r.request_id: r for r in self.live_requests()}
        requests.update(self._updated)
        self.store.rewrite(list(requests.values()))
        self._updates.clear()
        self._updated.clear()

    def pending_updates(self) -> list[RequestUpdate]:
        return list(self._updates.values())

    def has_pending(self, request_id: str) -> bool:
        """Whether a change or a delta of `request_id` is still buffered (not flushed)."""
        return request_id in self._updates or request_id in self._deltas

    def _update(self, request: Request) -> RequestUpdate:
        update = self._updates.get(request.request_id)
        if update is None:
            update = self._updates[request.request_id] = RequestUpdate(request.request_id)
            self._updated[request.request_id] = request
        return update

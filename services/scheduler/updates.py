"""What one step changed: state writes for the store and token deltas for the router.

The scheduler records every state change and appended token here while it plans and
processes results; `flush()` sends them to the store in one round trip and returns the
deltas. If the store is down, both stay buffered (and merge with the next step's), so no
token is lost or streamed before it is persisted; the store's appends are offset-checked, so
a flush that half-reached Redis and is sent again appends nothing twice. If the store lost
state (`StoreLost`: Redis restarted empty or stale), every live request and every request
with a buffered change is written whole again from memory, the source of truth.

`flush()` in three parts, for a caller that writes in another thread while it goes on
planning (the scheduler service): `take()` hands out what is buffered as a `Batch` and
starts an empty buffer, `write(batch)` persists it (any thread; one batch at a time), and
then either `done(batch)` returns its deltas or `give_back(batch)` puts it back in front of
what was buffered since, as if it had never been taken.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from services.common.errors import StoreLost
from services.common.step import TokenLogprobs
from services.scheduler.request import Request, RequestStatus
from services.scheduler.state import RequestUpdate, StateStore, TokenDelta

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class Batch:
    """Writes and deltas taken out of the buffer to be persisted together."""

    updates: dict[str, RequestUpdate] = field(default_factory=dict)
    updated: dict[str, Request] = field(default_factory=dict)
    """The request behind each update (what a rewrite writes whole)."""
    deltas: dict[str, TokenDelta] = field(default_factory=dict)
    moved: set[str] = field(default_factory=set)
    """Requests whose writes the store refused: another pipeline adopted them."""

    def __bool__(self) -> bool:
        return bool(self.updates or self.deltas)


class StepOutputs:
    """Buffers one step's writes and deltas until `flush()`."""

    def __init__(self, store: StateStore | None):
        self.store = store
        self.live_requests: Callable[[], Iterable[Request]] = list
        """Every unfinished request (set by the scheduler): what a lost store is rewritten
        with."""
        self._buffer = Batch()
        self._writing: Batch | None = None
        """The batch taken and not yet done or given back (being written)."""
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
        deltas = self._buffer.deltas
        delta = deltas.get(request.request_id)
        if delta is None:
            delta = deltas[request.request_id] = TokenDelta(
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
        batch = self.take()
        try:
            self.write(batch)
        except StoreLost as exc:
            self.give_back(batch)
            self.rewrite(exc)
            batch = self.take()
        except BaseException:
            self.give_back(batch)
            raise
        return self.done(batch)

    @property
    def is_writing(self) -> bool:
        """A batch is taken and neither done nor given back."""
        return self._writing is not None

    def has_buffered(self) -> bool:
        return bool(self._buffer)

    def take(self) -> Batch:
        """What is buffered, to be written; the buffer starts empty. One batch at a time."""
        assert self._writing is None, "a batch is being written already"
        self._writing, self._buffer = self._buffer, Batch()
        return self._writing

    def write(self, batch: Batch) -> None:
        """Persist `batch`'s writes (one round trip; any thread: it reads only the batch).
        Raises `StateStoreError`, or `StoreLost` (then `give_back` and `rewrite`)."""
        if self.store is not None and batch.updates:
            batch.moved = self.store.apply(list(batch.updates.values()))

    def done(self, batch: Batch) -> list[TokenDelta]:
        """`batch` is persisted: its deltas, to stream. A request another pipeline adopted
        has none: the store refused its tokens, and a client must never see a token the
        store lacks (it resumes at the new owner, which recomputes them)."""
        self._writing = None
        deltas = [d for i, d in batch.deltas.items() if i not in batch.moved]
        for delta in deltas:
            if not any(delta.logprobs):
                delta.logprobs = None
        return deltas

    def give_back(self, batch: Batch) -> None:
        """`batch` was not persisted: back in the buffer, in front of what came since (a
        request's later tokens after its earlier ones, its latest state on top)."""
        self._writing = None
        newer, self._buffer = self._buffer, batch
        _merge_into(batch.updates, newer.updates, _merge_update)
        batch.updated.update(newer.updated)
        _merge_into(batch.deltas, newer.deltas, _merge_delta)

    def rewrite(self, cause: StoreLost) -> None:
        """Writes every live request, and every one with a buffered change, whole again
        (the store lost state); the buffered changes are then in the store."""
        logger.warning("%s; writing every live request again", cause)
        requests = {r.request_id: r for r in self.live_requests()}
        requests.update(self._buffer.updated)
        self.store.rewrite(list(requests.values()))
        self._buffer.updates.clear()
        self._buffer.updated.clear()

    def pending_updates(self) -> list[RequestUpdate]:
        """The buffered writes and those being written."""
        writing = self._writing.updates.values() if self._writing is not None else ()
        return [*writing, *self._buffer.updates.values()]

    def has_pending(self, request_id: str) -> bool:
        """Whether a change or a delta of `request_id` is buffered or being written."""
        return any(
            request_id in batch.updates or request_id in batch.deltas
            for batch in (self._buffer, self._writing)
            if batch is not None
        )

    def _update(self, request: Request) -> RequestUpdate:
        updates = self._buffer.updates
        update = updates.get(request.request_id)
        if update is None:
            update = updates[request.request_id] = RequestUpdate(request.request_id)
            self._buffer.updated[request.request_id] = request
        return update


def _merge_into(older: dict, newer: dict, merge: Callable) -> None:
    """Each request's newer item merged into its older one (or added)."""
    for request_id, item in newer.items():
        if request_id in older:
            merge(older[request_id], item)
        else:
            older[request_id] = item


def _merge_update(older: RequestUpdate, newer: RequestUpdate) -> None:
    """`older` becomes both: its tokens then `newer`'s, and the newer state if one is set."""
    if not older.token_ids:
        older.offset = newer.offset
    older.token_ids.extend(newer.token_ids)
    if newer.status is not None:
        older.status, older.reason = newer.status, newer.reason


def _merge_delta(older: TokenDelta, newer: TokenDelta) -> None:
    older.token_ids.extend(newer.token_ids)
    older.logprobs.extend(newer.logprobs)
    older.finish_reason = newer.finish_reason or older.finish_reason
    older.num_spec_steps = newer.num_spec_steps
    older.num_spec_draft_tokens = newer.num_spec_draft_tokens
    older.num_spec_accepted_tokens = newer.num_spec_accepted_tokens

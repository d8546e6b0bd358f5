"""`DraftClient`: the scheduler's side of the draft worker (`conveyor worker --draft`).

Before planning a step, the service asks the draft worker for greedy tokens of the requests
the planner may speculate for (`Scheduler.draft_candidates`), sending per request only the
tokens it has not sent before. The draft worker is never on the path of a request's
correctness or liveness:

* a call that fails or takes longer than `draft_timeout_s` gives no proposals: the step
  runs without them, and the client rests (no call for a few timeouts) before it tries again;
* a draft worker that lost a request's state (restarted, evicted it) says so, and the
  request is sent again whole in a second call (within the same timeout);
* a request as long as the draft model's context (Describe's max_model_len) is not sent;
* a draft model whose vocabulary differs from the target's is refused for good (it would
  propose ids that mean other words), logged once and reported in `problem`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Collection
from dataclasses import dataclass

import grpc

from services.common.proto.conveyor.v1 import draft_pb2, draft_pb2_grpc, worker_pb2
from services.common.security import ClientSecurity
from services.scheduler.request import Request

logger = logging.getLogger(__name__)

REST_TIMEOUTS = 5
"""After a failed call, no call for this many `draft_timeout_s`."""


@dataclass(slots=True)
class DraftCounters:
    """What the draft worker did for this scheduler (`conveyor stats`, metrics)."""

    num_calls: int = 0
    """Propose calls that answered."""
    num_failures: int = 0
    """Calls that failed or timed out (their steps ran without proposals)."""
    num_resent: int = 0
    """Requests sent again whole because the draft worker had lost them."""


class DraftClient:
    """One channel to the draft worker and what each request has sent it."""

    def __init__(
        self,
        address: str,
        vocab_size: int,
        timeout_s: float,
        security: ClientSecurity | None = None,
    ):
        self.address = address
        self.vocab_size = vocab_size
        """The target's: a draft model with another vocabulary is refused."""
        self.timeout_s = timeout_s
        self.security = security or ClientSecurity()
        self._channel = self.security.channel(address)
        self._stub = draft_pb2_grpc.DraftWorkerStub(self._channel)
        self._metadata = self.security.with_metadata(None)
        self.counters = DraftCounters()
        self.problem: str | None = None
        """Why no proposals come now (None while the draft worker answers)."""
        self._is_checked = False
        self._is_refused = False
        self._rest_until = 0.0
        self.max_model_len: int | None = None
        """The draft model's context (Describe); longer requests are not sent."""
        self._num_sent: dict[str, int] = {}
        """Per request, the tokens the draft worker got from earlier calls."""

    async def close(self) -> None:
        await self._channel.close()

    async def propose(
        self, candidates: list[tuple[Request, int]], live_ids: Collection[str]
    ) -> dict[str, list[int]]:
        """Draft tokens for `candidates` (request, most tokens to propose); {} when the draft
        worker is down, slow, resting or refused. `live_ids`: the scheduler's unfinished
        requests (the others are freed on the draft worker with this call)."""
        if not candidates or self._is_refused or time.monotonic() < self._rest_until:
            return {}
        deadline = time.monotonic() + self.timeout_s
        try:
            if not self._is_checked:
                await self._check(deadline)
                if self._is_refused:
                    return {}
            candidates = self._within_context(candidates)
            if not candidates:
                return {}
            finished = [r for r in self._num_sent if r not in live_ids]
            proposals, unknown = await self._call(candidates, finished, deadline)
            for request_id in finished:
                self._num_sent.pop(request_id, None)
            if unknown:  # the draft worker lost them: send them whole, once
                self.counters.num_resent += len(unknown)
                again = [(r, k) for r, k in candidates if r.request_id in unknown]
                proposals.update((await self._call(again, [], deadline))[0])
        except Exception as exc:  # noqa: BLE001 - the draft worker never fails a step
            self._failed(exc)
            return {}
        if self.problem is not None:
            logger.info("the draft worker at %s answers again", self.address)
            self.problem = None
        return proposals

    def _within_context(self, candidates: list[tuple[Request, int]]) -> list[tuple[Request, int]]:
        """The candidates the draft model's context has room for, k cut to fit: a longer
        request would be skipped by the draft worker, named unknown at its next call, and
        sent whole again every step for nothing."""
        limit = self.max_model_len
        if limit is None:
            return candidates
        return [(r, min(k, limit - r.num_tokens)) for r, k in candidates if r.num_tokens < limit]

    async def _call(
        self, candidates: list[tuple[Request, int]], finished: list[str], deadline: float
    ) -> tuple[dict[str, list[int]], set[str]]:
        sequences = []
        for request, num_tokens in candidates:
            start = self._num_sent.get(request.request_id, 0)
            sequences.append(
                draft_pb2.DraftSequence(
                    request_id=request.request_id,
                    start=start,
                    token_ids=request.token_ids[start:],
                    num_tokens=num_tokens,
                )
            )
        msg = draft_pb2.ProposeRequest(sequences=sequences, finished_request_ids=finished)
        reply = await self._stub.Propose(
            msg, timeout=max(0.001, deadline - time.monotonic()), metadata=self._metadata
        )
        self.counters.num_calls += 1
        unknown = set(reply.unknown_request_ids)
        for request, _ in candidates:  # what the draft worker holds from now on
            if request.request_id in unknown:
                self._num_sent.pop(request.request_id, None)
            else:
                self._num_sent[request.request_id] = request.num_tokens
        proposals = {}
        for proposal in reply.proposals:
            tokens = list(proposal.token_ids)
            if all(t < self.vocab_size for t in tokens):
                proposals[proposal.request_id] = tokens
        return proposals, unknown

    async def _check(self, deadline: float) -> None:
        """Describe: not ready yet raises UNAVAILABLE (rest, try again); another vocabulary
        refuses the draft worker for good."""
        info = await self._stub.Describe(
            worker_pb2.DescribeRequest(),
            timeout=max(0.001, deadline - time.monotonic()),
            metadata=self._metadata,
        )
        if not info.ready:
            raise asyncio.TimeoutError("the draft model is still loading")
        self.max_model_len = info.max_model_len or None
        if info.vocab_size != self.vocab_size:
            self._is_refused = True
            self.problem = (
                f"the draft model {info.model_name!r} has a vocabulary of {info.vocab_size} "
                f"tokens, the served model {self.vocab_size}: a draft model must share the "
                "target's tokenizer; speculating without it"
            )
            logger.error("%s", self.problem)
        self._is_checked = True

    def _failed(self, exc: BaseException) -> None:
        self.counters.num_failures += 1
        if isinstance(exc, grpc.aio.AioRpcError):
            if exc.code() is grpc.StatusCode.UNAVAILABLE:
                self._is_checked = False  # maybe restarted: check its model again
            reason = f"{exc.code().name}: {exc.details()}"
        elif isinstance(exc, asyncio.TimeoutError):
            reason = f"no answer within {self.timeout_s:g} s ({exc or 'timeout'})"
        else:  # a bug: say where, once per failure streak
            reason = f"{type(exc).__name__}: {exc}"
            if self.problem is None:
                logger.error("draft proposals failed", exc_info=exc)
        if self.problem is None:
            logger.warning(
                "draft worker at %s: %s; steps run without its proposals", self.address, reason
            )
        self.problem = f"draft worker at {self.address}: {reason}"
        self._rest_until = time.monotonic() + REST_TIMEOUTS * self.timeout_s

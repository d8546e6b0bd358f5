"""The router's request path, shared by both public APIs (no protobuf here).

    GenerateInput --prepare--> PreparedRequest --Submit--> scheduler deltas
                                                 --OutputBuilder--> OutputDelta stream

Whenever the client's stream ends before the scheduler finished the request (a stop-string
match, a client cancel or deadline, an error), the request is aborted in the scheduler so
its KV blocks are freed within a step.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from services.common.auth import ANONYMOUS_PRINCIPAL, Principal
from services.common.errors import InvalidRequest, PermissionDenied, RequestFailed
from services.common.limits import check_priority, check_request_id
from services.router.detokenizer import PROMPT_CONTEXT_TOKENS
from services.router.observability import RequestObservation
from services.router.output import OutputBuilder, OutputDelta
from services.router.request import (
    GenerateInput,
    ModelLimits,
    PreparedRequest,
    prepare,
    tokenize_prompt,
)
from services.router.tokenizer import Tokenizer

if TYPE_CHECKING:  # the core itself never imports grpc
    from services.common.metrics import RouterMetrics
    from services.common.telemetry import Tracing
    from services.router.pool import SchedulerPool

logger = logging.getLogger(__name__)


@dataclass
class RouterCore:
    """Validation, tokenization, streaming and aborts for every request of one router."""

    tokenizer: Tokenizer
    limits: ModelLimits
    scheduler: SchedulerPool
    is_ready: bool = False  # the scheduler was SERVING at the last health poll
    metrics: RouterMetrics | None = None  # --metrics-port; None: no hook runs
    tracing: Tracing | None = None  # --otlp-endpoint; None: no span is created

    async def prepare(
        self, req: GenerateInput, principal: Principal = ANONYMOUS_PRINCIPAL
    ) -> PreparedRequest:
        """Validates and tokenizes a request of `principal`; raises InvalidRequest naming
        the bad field, PermissionDenied for a tenant that is not the principal's.

        Runs in a worker thread: tokenizing a long prompt (a megabyte takes seconds) must not
        hold up the other streams on this event loop."""
        check_priority(req.priority, self.limits.request)  # before a key's ceiling raises it
        apply_principal(req, principal)
        prepared = await asyncio.to_thread(prepare, req, self.tokenizer, self.limits)
        prepared.principal = principal.name
        return prepared

    async def tokenize(self, req: GenerateInput) -> list[int]:
        """The prompt's token ids (Tokenize), validated and computed as `prepare` does."""
        ids, _ = await asyncio.to_thread(tokenize_prompt, req, self.tokenizer, self.limits)
        return ids

    async def generate(self, req: PreparedRequest) -> AsyncIterator[OutputDelta]:
        """Streams the request's output; the last delta has a finish reason and usage.

        Raises:
            RequestFailed: the scheduler failed the request (finish reason "error").
            QueueFull, PipelineUnavailable, InvalidRequest: passed on from the scheduler.
        """
        builder = OutputBuilder.for_request(self.tokenizer, req)
        is_upstream_done = False
        obs = None
        if self.metrics is not None or self.tracing is not None:
            obs = RequestObservation(
                self.metrics, self.tracing, req.request_id, len(req.prompt_ids)
            )
        ended_as = None  # finish reason of a request the client stopped waiting for
        try:
            stream = self.scheduler.stream(req, metadata=obs.metadata if obs else None)
            async with contextlib.aclosing(stream) as deltas:
                async for delta in deltas:
                    is_upstream_done = delta.finish_reason is not None
                    out = builder.add(delta)
                    if out is None:
                        continue
                    if obs is not None:
                        obs.on_output(out)
                    if out.finish_reason == "error":
                        raise _failed(req.request_id, out)
                    yield out
                    if out.finish_reason is not None:
                        return
        except (asyncio.CancelledError, GeneratorExit):
            ended_as = "abort"  # the client cancelled or its deadline passed
            raise
        finally:
            if not is_upstream_done:
                self._abort_soon(req)
            if obs is not None:
                obs.end(ended_as)

    async def resume(
        self, request_id: str, offset: int, principal: Principal = ANONYMOUS_PRINCIPAL
    ) -> AsyncIterator[OutputDelta]:
        """Streams `principal`'s request `request_id` from output token `offset` on, as
        `generate` streamed it (whichever router took it; docs/scale-out.md), the last delta
        with the finish reason and usage. The last tokens before `offset` are read as the
        detokenizer's context, so a character split across `offset` comes out whole.

        Raises:
            UnknownRequest: no scheduler knows the id in the principal's namespace.
            InvalidRequest: a malformed id, or `offset` beyond the tokens generated so far.
            RequestFailed, PipelineUnavailable: as `generate`.
        """
        check_request_id(request_id)
        start = max(0, offset - PROMPT_CONTEXT_TOKENS)
        context: list[int] = []
        builder: OutputBuilder | None = None
        num_prompt_tokens = 0
        end: int | None = None  # the tokens so far, once the first answer came
        stream = self.scheduler.resume(request_id, principal.name, start)
        try:
            async with contextlib.aclosing(stream) as deltas:
                async for delta in deltas:
                    num_prompt_tokens = max(num_prompt_tokens, delta.num_prompt_tokens)
                    if builder is None:
                        end = delta.offset + len(delta.token_ids)
                        if not context and end < offset:  # the first answer has every token
                            raise _beyond(request_id, offset, end)
                        take = max(0, min(len(delta.token_ids), offset - delta.offset))
                        context.extend(delta.token_ids[:take])
                        if delta.offset + take < offset:
                            continue  # context still arriving
                        builder = OutputBuilder.for_resume(
                            self.tokenizer, context, offset, num_prompt_tokens
                        )
                        delta.token_ids = delta.token_ids[take:]
                        delta.logprobs = delta.logprobs[take:]
                        delta.offset += take
                    builder.num_prompt_tokens = num_prompt_tokens
                    out = builder.add(delta)
                    if out is None:
                        continue
                    if out.finish_reason == "error":
                        raise _failed(request_id, out)
                    yield out
                    if out.finish_reason is not None:
                        return
        except InvalidRequest as exc:
            if end is not None or start == 0:
                raise
            # The scheduler refused the context's offset (`start`, before `offset`) before
            # any answer: name the client's own, with the count it may resume from.
            raise _beyond(
                request_id, offset, await self._num_tokens(request_id, principal)
            ) from exc

    async def _num_tokens(self, request_id: str, principal: Principal) -> int:
        """How many output tokens `principal`'s request has so far."""
        stream = self.scheduler.resume(request_id, principal.name, 0)
        async with contextlib.aclosing(stream) as deltas:
            async for delta in deltas:
                return delta.offset + len(delta.token_ids)
        return 0

    def _abort_soon(self, req: PreparedRequest) -> None:
        """Sends the abort on the session without waiting, so that a cancelled caller still
        frees the blocks. Safe whatever became of the Submit: the scheduler acts only on the
        request this submission created (its owner token), so a refused duplicate id aborts
        nothing."""
        self.scheduler.abort(req.request_id, req.principal, req.owner_token)
        logger.debug("aborting %s", req.request_id)

    async def collect(self, req: PreparedRequest) -> tuple[str, OutputDelta]:
        """(whole text, last delta) of a request, for non-streaming APIs."""
        texts: list[str] = []
        last = None
        async for out in self.generate(req):
            texts.append(out.text)
            last = out
        assert last is not None and last.finish_reason is not None
        return "".join(texts), last


def _failed(request_id: str, out: OutputDelta) -> RequestFailed:
    return RequestFailed(
        f"request {request_id} failed in the scheduler: {out.error or 'no reason given'}"
    )


def _beyond(request_id: str, offset: int, num_tokens: int) -> InvalidRequest:
    return InvalidRequest(
        f"offset={offset} is beyond request {request_id}'s output: it has {num_tokens} tokens "
        "so far (resume from at most that)"
    )


def apply_principal(req: GenerateInput, principal: Principal) -> None:
    """Tenant and priority as the principal's credential allows (API keys): the tenant is the
    key's (another one is PERMISSION_DENIED), and a priority more urgent (lower) than the
    key's ceiling runs at the ceiling. Without keys both stay as the client declared them."""
    if principal.tenant is not None:
        if req.tenant and req.tenant != principal.tenant:
            raise PermissionDenied(
                f"tenant={req.tenant[:80]!r} is not yours: your credential runs requests as "
                f"tenant {principal.tenant!r} (leave tenant empty)"
            )
        req.tenant = principal.tenant
    if principal.priority_max is not None and req.priority < principal.priority_max:
        req.priority = principal.priority_max

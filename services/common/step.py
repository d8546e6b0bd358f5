"""Step plans: what the scheduler tells every stage worker to run for one micro-batch.

Plans are deltas (DESIGN.md "Step plans are deltas"): a request new to the workers is sent
whole (`NewRequest`); a request they already hold carries only what changed this step
(`CachedRequest`). Workers keep per-request state (block table, sampling params, tokens for
penalties, computed-token count) and drop it when the plan lists the request in
`finished_request_ids`. Plan size does not grow with context length.

A request scheduled in a step computes `num_scheduled_tokens` tokens starting at its
`num_computed_tokens` (known to the worker). A token is sampled for it when this step's chunk
reaches the end of its known tokens (prompt fully prefilled, or a decode step).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from services.common.sampling import SamplingParams

SESSION_ACCEPTED = "conveyor-session-accepted"
"""The initial metadata key a stage's Run sends once it took the session and reads its plans
(a stage busy with another scheduler's session refuses instead)."""


@dataclass(slots=True)
class NewRequest:
    """A request the workers have not seen, or see again after preemption or a restart."""

    request_id: str
    token_ids: list[int]
    """Prompt ids, followed by the tokens generated so far when the request is resumed."""
    num_prompt_tokens: int
    """Length of the original prompt; token_ids[num_prompt_tokens:] are output tokens."""
    sampling: SamplingParams
    block_ids: list[int]
    """The request's block table so far (prefix-cache hits first)."""
    num_computed_tokens: int
    """Tokens whose KV is already in the cache (prefix-cache hit): computing starts here."""
    num_scheduled_tokens: int
    """Tokens to compute this step (a prefill chunk, or the whole rest of the prompt)."""


@dataclass(slots=True)
class CachedRequest:
    """A request the workers already hold: only what changed since its last step."""

    request_id: str
    num_scheduled_tokens: int
    """Tokens to compute this step: 1 for a decode, more for the next prefill chunk."""
    new_block_ids: list[int] = field(default_factory=list)
    """Blocks appended to the request's block table for this step."""
    new_token_ids: list[int] = field(default_factory=list)
    """Sync mode: tokens sampled since the workers last heard of it (the decode input).
    Empty in async mode, where stage 0 takes the input token from the last stage (but for
    a request planned after a speculative step: then they are the tokens it yielded)."""
    spec_token_ids: list[int] = field(default_factory=list)
    """Speculative decoding: tokens proposed after the scheduled ones. The stages compute
    their positions too; the last stage keeps the prefix it would have sampled itself."""
    num_computed_tokens: int | None = None
    """Set after a speculative step: the request's true computed-token count, which rolls
    back the rejected drafts' positions (stages before the last cannot know them)."""

    @property
    def num_step_tokens(self) -> int:
        """Positions computed this step: the scheduled tokens and the proposed ones."""
        return self.num_scheduled_tokens + len(self.spec_token_ids)


@dataclass(slots=True)
class StepPlan:
    """One micro-batch for one global step; every stage receives the same plan."""

    step_id: int
    new_requests: list[NewRequest] = field(default_factory=list)
    cached_requests: list[CachedRequest] = field(default_factory=list)
    finished_request_ids: list[str] = field(default_factory=list)
    """Requests to forget before this step runs (finished, aborted or preempted)."""

    @property
    def num_requests(self) -> int:
        return len(self.new_requests) + len(self.cached_requests)

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(r.num_scheduled_tokens for r in self.new_requests) + sum(
            r.num_step_tokens for r in self.cached_requests
        )


@dataclass(slots=True)
class TokenLogprobs:
    """Log-probabilities at one sampled position."""

    token_logprob: float
    top_token_ids: list[int]
    top_logprobs: list[float]


@dataclass(slots=True)
class StepResult:
    """What the last stage reports for one step: the tokens of each sampling request.

    A request is listed once per token, in one contiguous run: one token for an ordinary
    step, 1 to k + 1 for a speculative step (the accepted drafts, then the last stage's own).
    """

    step_id: int
    request_ids: list[str]
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None] | None = None

    def runs(self) -> list[tuple[str, list[int], list[TokenLogprobs | None]]]:
        """(request id, its tokens, their logprobs) per request, in order; raises ValueError
        when a request's tokens are not one contiguous run."""
        logprobs = self.logprobs or [None] * len(self.request_ids)
        runs: list[tuple[str, list[int], list[TokenLogprobs | None]]] = []
        seen: set[str] = set()
        for request_id, token_id, lp in zip(
            self.request_ids, self.token_ids, logprobs, strict=True
        ):
            if runs and runs[-1][0] == request_id:
                runs[-1][1].append(token_id)
                runs[-1][2].append(lp)
                continue
            if request_id in seen:
                raise ValueError(
                    f"step {self.step_id} result lists request {request_id} in two places"
                )
            seen.add(request_id)
            runs.append((request_id, [token_id], [lp]))
        return runs

    def last_tokens(self) -> list[int]:
        """The last token of each request (the next decode input), in order."""
        return [tokens[-1] for _, tokens, _ in self.runs()]

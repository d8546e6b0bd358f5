"""Turns the scheduler's token deltas into the text a client sees (pure).

Each token goes through the incremental detokenizer (no broken characters) and the stop
matcher (stop strings across token boundaries); a stop-string match ends the output at the
token that completed it, with finish reason "stop", even though the scheduler has not
finished the request (the caller aborts it there).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from services.common.step import TokenLogprobs
from services.router.detokenizer import IncrementalDetokenizer
from services.router.request import PreparedRequest
from services.router.stop import StopMatcher
from services.router.tokenizer import Tokenizer

FINISH_REASONS = ("stop", "length", "abort", "error")


@dataclass(slots=True)
class SchedulerDelta:
    """New tokens of one request as the scheduler sent them (offsets already deduplicated)."""

    offset: int
    token_ids: list[int]
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None  # one of FINISH_REASONS on the last delta
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    error: str = ""
    weight_version: int = 0
    """The weights that produced these tokens (the scheduler's UpdateWeights)."""


@dataclass(slots=True)
class Usage:
    """Token counts of a finished request."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0


@dataclass(slots=True)
class OutputDelta:
    """What the client receives for one scheduler delta."""

    text: str
    token_ids: list[int]
    offset: int
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    usage: Usage | None = None
    error: str = ""
    weight_version: int = 0
    text_lengths: list[int] = field(default_factory=list)
    """Per token, the characters it added to the text before stop strings are applied: a
    token that begins a character cut between tokens adds none, the one that completes it
    adds the character (completions' logprobs `text_offset`)."""


@dataclass(slots=True)
class OutputBuilder:
    """Per-request output state. `add()` each scheduler delta in order."""

    detokenizer: IncrementalDetokenizer
    matcher: StopMatcher
    num_prompt_tokens: int
    min_tokens: int = 0
    """Output tokens whose text no stop string may end in (the request's min_tokens)."""
    num_tokens: int = 0
    num_cached_tokens: int = 0
    is_finished: bool = False

    @classmethod
    def for_request(cls, tokenizer: Tokenizer, req: PreparedRequest) -> OutputBuilder:
        return cls(
            detokenizer=IncrementalDetokenizer.for_prompt(tokenizer, req.prompt_ids),
            matcher=StopMatcher(req.stop, req.include_stop_str_in_output),
            num_prompt_tokens=len(req.prompt_ids),
            min_tokens=req.sampling.min_tokens,
        )

    @classmethod
    def for_resume(
        cls, tokenizer: Tokenizer, context_ids: list[int], offset: int, num_prompt_tokens: int
    ) -> OutputBuilder:
        """Output after the first `offset` tokens (Resume), whose last ones are `context_ids`.
        No stop strings: a router that did not take the Generate does not know them."""
        return cls(
            detokenizer=IncrementalDetokenizer.for_resume(tokenizer, context_ids),
            matcher=StopMatcher([], False),
            num_prompt_tokens=num_prompt_tokens,
            num_tokens=offset,
        )

    @property
    def is_stopped_by_string(self) -> bool:
        return self.matcher.is_stopped

    def add(self, delta: SchedulerDelta) -> OutputDelta | None:
        """The client-visible delta, or None when there is nothing to send."""
        if self.is_finished:
            return None
        self.num_cached_tokens = max(self.num_cached_tokens, delta.num_cached_tokens)
        offset = self.num_tokens
        texts: list[str] = []
        token_ids: list[int] = []
        lengths: list[int] = []
        for token_id in delta.token_ids:
            can_stop = self.num_tokens + len(token_ids) >= self.min_tokens
            piece = self.detokenizer.step([token_id])
            lengths.append(len(piece))
            texts.append(self.matcher.feed(piece, can_stop))
            token_ids.append(token_id)
            if self.matcher.is_stopped:
                break
        logprobs = list(delta.logprobs[: len(token_ids)])
        self.num_tokens += len(token_ids)
        finish = "stop" if self.matcher.is_stopped else delta.finish_reason
        if finish is not None and not self.matcher.is_stopped:
            # The held-back characters belong to the last token.
            can_stop = self.num_tokens > self.min_tokens
            piece = self.detokenizer.flush()
            if lengths:
                lengths[-1] += len(piece)
            texts.append(self.matcher.feed(piece, can_stop))
            texts.append(self.matcher.flush())
            finish = "stop" if self.matcher.is_stopped else finish
        if finish is None and not token_ids:
            return None
        out = OutputDelta(
            text="".join(texts),
            token_ids=token_ids,
            offset=offset,
            logprobs=logprobs,
            finish_reason=finish,
            weight_version=delta.weight_version,
            text_lengths=lengths,
        )
        if finish is not None:
            self.is_finished = True
            out.error = delta.error
            out.usage = Usage(self.num_prompt_tokens, self.num_tokens, self.num_cached_tokens)
        return out

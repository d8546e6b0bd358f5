"""Sampling parameters, with vLLM's names and meanings, shared by router, scheduler and worker."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.common.errors import InvalidRequest


@dataclass(slots=True)
class SamplingParams:
    """How the last stage picks each next token of one request.

    Defaults give greedy decoding. Validation raises `InvalidRequest` naming the field, the
    value and the allowed range.
    """

    temperature: float = 0.0
    """Softmax temperature; 0 means greedy (argmax). Range [0, 100]."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose mass reaches top_p. Range (0, 1]."""
    top_k: int = 0
    """Keep only the k most likely tokens; 0 (or -1 from vLLM clients) disables it."""
    min_p: float = 0.0
    """Drop tokens whose probability is below min_p times the top token's. Range [0, 1]."""
    repetition_penalty: float = 1.0
    """Divide positive (multiply negative) logits of tokens seen in prompt or output. > 0."""
    presence_penalty: float = 0.0
    """Subtract from logits of tokens present in the output. Range [-2, 2]."""
    frequency_penalty: float = 0.0
    """Subtract, times the count, from logits of tokens in the output. Range [-2, 2]."""
    seed: int | None = None
    """Per-request seed: the same seed gives the same tokens whatever else is in the batch."""
    max_tokens: int = 16
    """How many tokens to generate at most. >= 1."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Token ids that finish the request (the token itself is kept in the output)."""
    ignore_eos: bool = False
    """Keep generating past the model's EOS token."""
    logprobs: int | None = None
    """Return the log-probabilities of the top-n tokens (and of the sampled one). Range [0, 20]."""

    def __post_init__(self) -> None:
        if self.top_k == -1:
            self.top_k = 0
        _check_range("temperature", self.temperature, 0.0, 100.0)
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequest(f"top_p={self.top_p} is out of range: must be in (0, 1]")
        if self.top_k < 0:
            raise InvalidRequest(f"top_k={self.top_k} is out of range: must be >= 0 (0 disables)")
        _check_range("min_p", self.min_p, 0.0, 1.0)
        if self.repetition_penalty <= 0.0:
            raise InvalidRequest(
                f"repetition_penalty={self.repetition_penalty} is out of range: must be > 0"
            )
        _check_range("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_range("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        if self.max_tokens < 1:
            raise InvalidRequest(f"max_tokens={self.max_tokens} is out of range: must be >= 1")
        if self.logprobs is not None:
            _check_range("logprobs", self.logprobs, 0, 20)
        if any(t < 0 for t in self.stop_token_ids):
            raise InvalidRequest(f"stop_token_ids={self.stop_token_ids} must be non-negative")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )


def _check_range(name: str, value: float, low: float, high: float) -> None:
    if not low <= value <= high:
        raise InvalidRequest(f"{name}={value} is out of range: must be in [{low}, {high}]")

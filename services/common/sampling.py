"""Sampling parameters, with vLLM's names and meanings, shared by router, scheduler and worker."""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

from services.common.errors import InvalidRequest

GREEDY_BELOW = 1e-5
"""Temperatures below this mean greedy, as in vLLM (_SAMPLING_EPS): dividing logits by a
tinier one overflows float32."""
MAX_TOP_K = 2**31 - 1  # int32 on the wire
MAX_SEED = 2**64 - 1  # uint64 on the wire
MAX_UINT32 = 2**32 - 1  # max_tokens, min_tokens, stop_token_ids, logprobs: uint32 on the wire
FLOAT_MIN = sys.float_info.min
"""Smallest normal double (2.2e-308): a smaller magnitude but 0 (a subnormal) is refused.
What is normal as a double but tiny in float32 (the workers' logits) is harmless within
each field's range: temperatures that small mean greedy, penalties are bounded away."""
_FLOAT_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
)


@dataclass(slots=True)
class SamplingParams:
    """How the last stage picks each next token of one request.

    Defaults give greedy decoding. Validation raises `InvalidRequest` naming the field, the
    value and the allowed range.
    """

    temperature: float = 0.0
    """Softmax temperature; 0 means greedy (argmax), and so does anything below 1e-5.
    Range [0, 100]."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose mass reaches top_p. Range (0, 1]."""
    top_k: int = 0
    """Keep only the k most likely tokens; 0 (or -1 from vLLM clients) disables it.
    Range [0, 2^31 - 1]."""
    min_p: float = 0.0
    """Drop tokens whose probability is below min_p times the top token's. Range [0, 1]."""
    repetition_penalty: float = 1.0
    """Divide positive (multiply negative) logits of tokens seen in prompt or output.
    Range [0.01, 100]."""
    presence_penalty: float = 0.0
    """Subtract from logits of tokens present in the output. Range [-2, 2]."""
    frequency_penalty: float = 0.0
    """Subtract, times the count, from logits of tokens in the output. Range [-2, 2]."""
    seed: int | None = None
    """Per-request seed: the same seed gives the same tokens whatever else is in the batch.
    Range [0, 2^64 - 1]."""
    max_tokens: int = 16
    """How many tokens to generate at most. Range [1, 2^32 - 1]."""
    min_tokens: int = 0
    """How many tokens to generate at least: until then EOS and stop_token_ids are masked
    out of sampling (vLLM's meaning), so they cannot end the request. Range [0, max_tokens]."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Token ids that finish the request (the token itself is kept in the output). Their
    number and range against the model are checked by services/common/limits.py."""
    ignore_eos: bool = False
    """Keep generating past the model's EOS token."""
    logprobs: int | None = None
    """Return the log-probabilities of the top-n tokens (and of the sampled one). Its limit
    (`--max-logprobs`, 20) is checked by services/common/limits.py."""

    def __post_init__(self) -> None:
        if self.top_k == -1:
            self.top_k = 0
        for name in _FLOAT_FIELDS:
            _check_float(name, getattr(self, name))
        _check_range("temperature", self.temperature, 0.0, 100.0)
        if self.temperature < GREEDY_BELOW:
            self.temperature = 0.0
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequest(f"top_p={self.top_p} is out of range: must be in (0, 1]")
        if not 0 <= self.top_k <= MAX_TOP_K:
            raise InvalidRequest(
                f"top_k={self.top_k} is out of range: must be in [0, {MAX_TOP_K}] (0 disables)"
            )
        _check_range("min_p", self.min_p, 0.0, 1.0)
        _check_range("repetition_penalty", self.repetition_penalty, 0.01, 100.0)
        _check_range("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_range("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        if not 1 <= self.max_tokens <= MAX_UINT32:
            raise InvalidRequest(
                f"max_tokens={self.max_tokens} is out of range: must be in [1, {MAX_UINT32}]"
            )
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidRequest(
                f"min_tokens={self.min_tokens} is out of range: must be in [0, max_tokens="
                f"{self.max_tokens}]"
            )
        if self.seed is not None and not 0 <= self.seed <= MAX_SEED:
            raise InvalidRequest(f"seed={self.seed} is out of range: must be in [0, {MAX_SEED}]")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_UINT32:
            raise InvalidRequest(f"logprobs={self.logprobs} is out of range: must be >= 0")
        ids = self.stop_token_ids
        if ids and (min(ids) < 0 or max(ids) > MAX_UINT32):
            index, bad = next((i, t) for i, t in enumerate(ids) if not 0 <= t <= MAX_UINT32)
            raise InvalidRequest(
                f"stop_token_ids[{index}]={bad} is out of range: must be in [0, {MAX_UINT32}]"
            )

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    def masked_token_ids(
        self, num_output_tokens: int, eos_token_ids: Sequence[int] = ()
    ) -> list[int]:
        """Token ids that may not be sampled as output token `num_output_tokens` (0-based):
        before min_tokens, those that would end the request (every EOS id unless ignored,
        and stop_token_ids); none after."""
        if num_output_tokens >= self.min_tokens:
            return []
        eos = [] if self.ignore_eos else list(eos_token_ids)
        return [*eos, *self.stop_token_ids]

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )


def _check_float(name: str, value: float) -> None:
    """NaN, infinities and subnormal numbers are refused."""
    if not math.isfinite(value):
        raise InvalidRequest(f"{name}={value} is not a finite number")
    if 0.0 < abs(value) < FLOAT_MIN:
        raise InvalidRequest(
            f"{name}={value!r} is subnormal: use 0 or a magnitude of at least {FLOAT_MIN:.3g}"
        )


def _check_range(name: str, value: float, low: float, high: float) -> None:
    if not low <= value <= high:
        raise InvalidRequest(f"{name}={value} is out of range: must be in [{low}, {high}]")

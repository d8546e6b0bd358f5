"""Speculative decoding, the scheduler's part: the config, the n-gram proposer, adaptivity.

The scheduler proposes up to k tokens per decoding request, from the request's own token
log (prompt lookup) or from a draft model (services/scheduler/drafts.py asks the draft
worker): the stages compute them beside the decode input and the last stage keeps the
prefix it would have sampled itself (docs/speculative-decoding.md).

    log:   … a b c d e f … x a b c        suffix "a b c" (n = prompt_lookup_max … min)
                 └─┬─┘ └─┬─┘               found earlier: propose what followed, "d e f"
                 match  proposal
"""

from __future__ import annotations

import json
from array import array
from dataclasses import dataclass, fields

from services.common.errors import ConfigError

MAX_NUM_SPECULATIVE_TOKENS = 16
"""Largest k accepted: more proposed tokens than this are almost never all accepted."""
MAX_PROMPT_LOOKUP = 32
METHODS = ("ngram", "draft_model")


@dataclass(slots=True)
class SpeculativeConfig:
    """`--speculative-config` (vLLM's JSON keys): how many tokens to propose and how."""

    method: str = "ngram"
    """The proposer: "ngram" (prompt lookup) or "draft_model" (greedy tokens of `model`,
    run by a draft worker); a config with `model` and no method is "draft_model"."""
    model: str | None = None
    """The draft model's directory ("draft_model" only); it must share the target's
    vocabulary (tokenizer)."""
    num_speculative_tokens: int = 4
    """k: most tokens proposed per step, in [1, 16]."""
    prompt_lookup_max: int = 4
    """Longest suffix looked up in the request's tokens."""
    prompt_lookup_min: int = 1
    """Shortest suffix looked up; a shorter match proposes nothing."""
    probe_interval: int = 16
    """Output tokens a request decodes without speculation once its k fell to 0, before it
    tries again with k = 1."""
    draft_timeout_s: float = 1.0
    """"draft_model": how long a step waits for the draft worker's proposals; a step whose
    call fails or times out runs without, and the next call waits `draft_timeout_s` x 5."""

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ConfigError(
                f"--speculative-config: method={self.method!r} is not one of {list(METHODS)}"
            )
        if self.model is not None and not isinstance(self.model, str):
            raise ConfigError(
                f"--speculative-config: model={self.model!r} is not a directory name: give "
                'the draft model\'s directory as a string, e.g. "model": "/models/draft"'
            )
        if self.method == "draft_model" and not self.model:
            raise ConfigError(
                '--speculative-config: method "draft_model" needs "model": the draft '
                "model's directory"
            )
        if self.method == "ngram" and self.model:
            raise ConfigError(
                '--speculative-config: "model" is for method "draft_model" (the n-gram '
                "proposer runs no model)"
            )
        timeout = self.draft_timeout_s
        if (
            isinstance(timeout, bool)
            or not isinstance(timeout, int | float)
            or not 0 < timeout <= 60
        ):
            raise ConfigError(
                f"--speculative-config: draft_timeout_s={timeout!r} is out of range: seconds "
                "in (0, 60]"
            )
        _in_range(
            "num_speculative_tokens", self.num_speculative_tokens, 1, MAX_NUM_SPECULATIVE_TOKENS
        )
        _in_range("prompt_lookup_max", self.prompt_lookup_max, 1, MAX_PROMPT_LOOKUP)
        _in_range("prompt_lookup_min", self.prompt_lookup_min, 1, self.prompt_lookup_max)
        _in_range("probe_interval", self.probe_interval, 1, 1 << 20)

    @classmethod
    def from_json(cls, text: str) -> SpeculativeConfig:
        """Parses the flag's JSON object; raises ConfigError saying what is wrong."""
        try:
            values = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"--speculative-config is not valid JSON: {exc}") from None
        if not isinstance(values, dict):
            raise ConfigError(
                '--speculative-config must be a JSON object, e.g. \'{"method": "ngram", '
                '"num_speculative_tokens": 4, "prompt_lookup_max": 4}\''
            )
        if "model" in values and "method" not in values:
            values["method"] = "draft_model"  # vLLM's form: {"model": DIR, ...}
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(
                f"--speculative-config: unknown key(s) {unknown}; known: {sorted(known)}"
            )
        return cls(**values)

    @property
    def uses_draft_model(self) -> bool:
        return self.method == "draft_model"

    def to_json(self) -> str:
        return json.dumps({f.name: getattr(self, f.name) for f in fields(self)})


def _in_range(name: str, value, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ConfigError(
            f"--speculative-config: {name}={value!r} is out of range: an integer in [{low}, {high}]"
        )


def propose_ngram(token_ids: list[int], num_tokens: int, max_n: int, min_n: int) -> list[int]:
    """Up to `num_tokens` tokens that followed an earlier occurrence of the longest suffix
    of `token_ids` (n from `max_n` down to `min_n`); [] when none occurs.

    Occurrences followed by `num_tokens` tokens come first (longest n, then the most
    recent); only when there is none, the most recent of those whose continuation runs
    into the suffix (e.g. a repeated token), which propose fewer.
    """
    length = len(token_ids)
    if num_tokens <= 0:
        return []
    sizes = range(min(max_n, length - 1), min_n - 1, -1)
    for is_full in (True, False):
        for n in sizes:
            last_full = length - n - num_tokens  # starts up to here have a full continuation
            starts = (
                range(last_full, -1, -1)
                if is_full
                else range(length - n - 1, max(last_full, -1), -1)
            )
            suffix = token_ids[length - n :]
            for start in starts:
                if token_ids[start] == suffix[0] and token_ids[start : start + n] == suffix:
                    return token_ids[start + n : start + n + num_tokens]
    return []


def tail_recurs(token_ids: list[int], length: int, packed: bytearray | None = None) -> bool:
    """Whether the last `length` tokens occurred before (overlaps allowed): prompt lookup of
    the `length - 1` before the last token would have found it, had the request been
    proposing. A request whose k fell to 0 probes again as soon as this holds (its output
    has begun to repeat), rather than after a fixed wait. One byte search in C over
    `packed`, the ids as int32 bytes, which the caller keeps between calls and this
    extends by the ids added since (building it whole took ~28 µs at 2,048 tokens, the
    search ~2 µs): cheap enough for every plain-decoded token."""
    num = len(token_ids)
    if length < 1 or num <= length:
        return False
    if packed is None:
        packed = bytearray()
    have = len(packed) // 4
    if have > num:  # not this log's bytes: start again
        packed.clear()
        have = 0
    packed += array("i", token_ids[have:]).tobytes()  # token ids < 2 ** 31
    tail, end = packed[-4 * length :], 4 * (num - 1)  # occurrences ending before the last
    found = packed.find(tail, 0, end)
    while found >= 0 and found % 4:  # a match across id boundaries: not an occurrence
        found = packed.find(tail, found + 1, end)
    return found >= 0


@dataclass(slots=True)
class SpecStats:
    """Counts of one request's (or the scheduler's) speculative steps."""

    num_steps: int = 0
    """Steps that carried proposed tokens."""
    num_draft_tokens: int = 0
    """Tokens proposed."""
    num_accepted_tokens: int = 0
    """Proposed tokens the model confirmed."""

    def add(self, num_drafts: int, num_accepted: int) -> None:
        self.num_steps += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted

    @property
    def acceptance_rate(self) -> float:
        """Accepted / proposed tokens (0 when nothing was proposed)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a speculative step yielded on average: accepted drafts + the model's own."""
        return (
            (self.num_accepted_tokens + self.num_steps) / self.num_steps if self.num_steps else 0.0
        )


def next_num_tokens(k: int, num_drafts: int, num_accepted: int, max_k: int) -> int:
    """A request's k after a step that proposed `num_drafts` and had `num_accepted` of them
    confirmed: up by one when all were, halved when none was (or nothing was proposed)."""
    if num_drafts and num_accepted == num_drafts:
        return min(max_k, k + 1)
    if num_accepted == 0:
        return k // 2
    return k

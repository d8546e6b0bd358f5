"""Bounds on a request's fields, enforced by every service where the request enters it.

The router checks them before it tokenizes; the scheduler checks them again on Submit,
because it trusts no caller (services/scheduler/validation.py). Both take their limits from
flags of the same names (`--max-stop-token-ids`, `--max-logprobs`, `--max-tenant-chars`,
`--max-abs-priority`). Every violation raises `InvalidRequest` whose message names the field,
the value (clipped) and the limit.

Token ids are checked against the model's embedding rows (config.json `vocab_size`), not the
tokenizer's vocabulary: the two differ for many models, and an id past the embedding is an
index error on stage 0 (a device assert on CUDA).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

from services.common.errors import InvalidRequest
from services.common.sampling import SamplingParams

REQUEST_ID_PATTERN = re.compile(r"\A[A-Za-z0-9._:-]{1,128}\Z")
"""Caller-chosen request ids: `\\Z`, not `$`, so that a trailing newline is refused."""

DEFAULT_MAX_STOP_TOKEN_IDS = 128
DEFAULT_MAX_LOGPROBS = 20  # vLLM's --max-logprobs
DEFAULT_MAX_TENANT_CHARS = 128
DEFAULT_MAX_ABS_PRIORITY = 1000
DEFAULT_MAX_MESSAGE_BYTES = 4 << 20  # gRPC's own default receive limit
MIN_MESSAGE_BYTES = 4096
"""A receive limit below this would refuse health checks and ordinary requests."""
MAX_WEIGHT = 1e6
"""Largest fair-share weight a Submit may carry."""


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """The limits the router and the scheduler both enforce (each from its own flags)."""

    max_stop_token_ids: int = DEFAULT_MAX_STOP_TOKEN_IDS
    """Most stop token ids in one request (`--max-stop-token-ids`)."""
    max_logprobs: int = DEFAULT_MAX_LOGPROBS
    """Largest `logprobs` (top-n log-probabilities per token) (`--max-logprobs`)."""
    max_tenant_chars: int = DEFAULT_MAX_TENANT_CHARS
    """Longest tenant name, in characters (`--max-tenant-chars`)."""
    max_abs_priority: int = DEFAULT_MAX_ABS_PRIORITY
    """Priority must be in [-N, N] (`--max-abs-priority`)."""


def clip(value: object, limit: int = 60) -> str:
    """repr(value), cut to about `limit` characters: error messages quote what the client
    sent, and a client may send megabytes."""
    text = repr(value)
    if len(text) <= limit:
        return text
    if isinstance(value, bytes):
        return f"{text[:limit]}... ({len(value)} bytes)"
    # the value's own length: repr's quotes and escapes are not what the client sent
    size = len(value) if isinstance(value, str) else len(text)
    return f"{text[:limit]}... ({size} characters)"


def lone_surrogate_at(value: object, path: str = "") -> str | None:
    """Where in a parsed JSON value (dicts, lists, strings) a string holds a lone surrogate,
    as `a.b[2]`, or None. JSON's `\\ud800`-style escapes decode to them in Python, and no
    text encoding can hold one: the tokenizer, protobuf and Redis would each fail on it."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path or "the body"
    elif isinstance(value, dict):
        for key, item in value.items():
            if lone_surrogate_at(key) is not None:  # not quoted: it cannot be encoded
                return f"a key of {path or 'the body'}"
            found = lone_surrogate_at(item, f"{path}.{key}" if path else str(key))
            if found:
                return found
    elif isinstance(value, list):
        for index, item in enumerate(value):
            if not isinstance(item, int | float):  # long token id lists: nothing to look at
                found = lone_surrogate_at(item, f"{path}[{index}]")
                if found:
                    return found
    return None


def check_unicode(value: object, name: str = "") -> None:
    """Raises InvalidRequest naming where `value` holds a lone surrogate."""
    where = lone_surrogate_at(value, name)
    if where is not None:
        raise InvalidRequest(
            f"{where} is not valid Unicode: it holds a lone surrogate (an unpaired \\ud800-"
            "\\udfff escape); send text that UTF-8 can encode"
        )


def check_request_id(request_id: str) -> None:
    """Raises InvalidRequest unless `request_id` is 1 to 128 of [A-Za-z0-9._:-]."""
    if not REQUEST_ID_PATTERN.match(request_id):
        raise InvalidRequest(
            f"request_id={clip(request_id)} is not allowed: use 1 to 128 letters, digits, "
            "'-', '_', '.' or ':'"
        )


def check_token_ids(name: str, token_ids: Sequence[int], vocab_size: int) -> None:
    """Raises InvalidRequest unless every id is in [0, vocab_size) (the model's embedding
    rows). `name` is the field, e.g. "token_ids"."""
    if not token_ids or (min(token_ids) >= 0 and max(token_ids) < vocab_size):
        return
    index, bad = next((i, t) for i, t in enumerate(token_ids) if not 0 <= t < vocab_size)
    raise InvalidRequest(
        f"{name}[{index}]={bad} is out of range: token ids must be in [0, {vocab_size - 1}] "
        f"(the model's vocab_size is {vocab_size})"
    )


def check_request(
    sampling: SamplingParams,
    priority: int,
    tenant: str,
    limits: RequestLimits,
    vocab_size: int,
) -> None:
    """The bounds of a request's fields that do not depend on its prompt; raises
    InvalidRequest naming the first field out of bounds."""
    num_stop_ids = len(sampling.stop_token_ids)
    if num_stop_ids > limits.max_stop_token_ids:
        raise InvalidRequest(
            f"stop_token_ids has {num_stop_ids} ids, too many: at most "
            f"{limits.max_stop_token_ids} (--max-stop-token-ids)"
        )
    check_token_ids("stop_token_ids", sampling.stop_token_ids, vocab_size)
    max_logprobs = min(limits.max_logprobs, vocab_size)
    if sampling.logprobs is not None and sampling.logprobs > max_logprobs:
        raise InvalidRequest(
            f"logprobs={sampling.logprobs} is out of range: must be in [0, {max_logprobs}] "
            "(--max-logprobs)"
        )
    check_priority(priority, limits)
    if len(tenant) > limits.max_tenant_chars:
        raise InvalidRequest(
            f"tenant has {len(tenant)} characters, too long: at most "
            f"{limits.max_tenant_chars} (--max-tenant-chars)"
        )


def check_priority(priority: int, limits: RequestLimits) -> None:
    """Raises InvalidRequest unless `priority` is in [-N, N] (`--max-abs-priority`)."""
    bound = limits.max_abs_priority
    if not -bound <= priority <= bound:
        raise InvalidRequest(
            f"priority={priority} is out of range: must be in [{-bound}, {bound}] "
            "(--max-abs-priority)"
        )


def check_weight(weight: float) -> None:
    """A fair-share weight: 0 (the default, 1) or finite in (0, MAX_WEIGHT]."""
    if weight == 0.0:
        return
    if not (math.isfinite(weight) and 0.0 < weight <= MAX_WEIGHT):
        raise InvalidRequest(
            f"weight={weight!r} is out of range: must be 0 (the default) or in (0, {MAX_WEIGHT:g}]"
        )

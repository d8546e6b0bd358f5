"""Benchmark workloads: seeded prompts as token ids, and the times requests are sent.

Prompts are token ids drawn from a *pool* of ids that the served tokenizer really produces
(the driver tokenizes a built-in word list once through the router's Tokenize RPC), so the
same workload runs against any model without knowing its vocabulary.

    random:  prompt i = input_len_i random ids;        input_len_i  ~ U[L(1-r), L(1+r)]
    prefix:  prompt i = prefix[i % num_prefixes] + input_len_i random ids
             (the prefixes are prefix_len ids each, shared, to exercise the prefix cache)
    repeat:  prompt i = "Repeat the following text..." + text_i + "... Repeated text:"
             (text_i = input_len_i random ids; the output copies it: what speculative
             decoding's prompt lookup is for)
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import numpy as np

logger = logging.getLogger(__name__)

# Tokenized once through the server to give the pool of valid prompt ids.
WORDS = (
    "time person year way day thing man world life hand part child eye woman place work "
    "week case point government company number group problem fact be have do say get make "
    "go know take see come think look want give use find tell ask seem feel try leave call "
    "good new first last long great little own other old right big high different small "
    "large next early young important few public bad same able to of in for on with at by "
    "from up about into over after river mountain garden window kitchen engine planet "
    "stage pipeline token model scheduler worker router cache block memory bubble signal "
    "quiet yellow purple orange silver golden wooden stone paper glass metal cotton"
)


@dataclass(slots=True)
class BenchRequest:
    """One request of a workload."""

    prompt_ids: list[int]
    output_len: int  # max_tokens (exactly this many with ignore_eos)


def _lengths(rng: np.random.Generator, mean: int, range_ratio: float, n: int) -> list[int]:
    """n lengths uniform in [mean(1-r), mean(1+r)], at least 1."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range_ratio={range_ratio} must be in [0, 1)")
    low = max(1, math.floor(mean * (1 - range_ratio)))
    high = max(low, math.ceil(mean * (1 + range_ratio)))
    return rng.integers(low, high + 1, size=n).tolist()


def _sample_ids(rng: np.random.Generator, token_pool: list[int], n: int) -> list[int]:
    return [token_pool[i] for i in rng.integers(0, len(token_pool), size=n)]


def random_requests(
    token_pool: list[int],
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float = 0.0,
    seed: int = 0,
) -> list[BenchRequest]:
    """`num_prompts` prompts of random ids from `token_pool` (same seed, same prompts)."""
    if not token_pool:
        raise ValueError("token_pool is empty: no ids to build prompts from")
    rng = np.random.default_rng(seed)
    input_lens = _lengths(rng, input_len, range_ratio, num_prompts)
    output_lens = _lengths(rng, output_len, range_ratio, num_prompts)
    return [
        BenchRequest(_sample_ids(rng, token_pool, n_in), n_out)
        for n_in, n_out in zip(input_lens, output_lens, strict=True)
    ]


def prefix_requests(
    token_pool: list[int],
    num_prompts: int,
    prefix_len: int,
    input_len: int,
    output_len: int,
    num_prefixes: int = 1,
    range_ratio: float = 0.0,
    seed: int = 0,
) -> list[BenchRequest]:
    """Prompts that start with one of `num_prefixes` shared prefixes of `prefix_len` ids,
    followed by `input_len` (± range_ratio) random ids of their own."""
    if num_prefixes < 1:
        raise ValueError(f"num_prefixes={num_prefixes} must be >= 1")
    rng = np.random.default_rng(seed + 1)
    prefixes = [_sample_ids(rng, token_pool, prefix_len) for _ in range(num_prefixes)]
    suffixed = random_requests(token_pool, num_prompts, input_len, output_len, range_ratio, seed)
    return [
        BenchRequest(prefixes[i % num_prefixes] + r.prompt_ids, r.output_len)
        for i, r in enumerate(suffixed)
    ]


REPEAT_HEAD = "Repeat the following text exactly, word for word.\n\nText: "
REPEAT_TAIL = "\n\nRepeated text: "
"""The instruction around a repeat prompt's text (tokenized by the served tokenizer)."""


def repeat_requests(
    token_pool: list[int],
    num_prompts: int,
    input_len: int,
    output_len: int,
    head_ids: list[int],
    tail_ids: list[int],
    range_ratio: float = 0.0,
    seed: int = 0,
) -> list[BenchRequest]:
    """Prompts asking to repeat a text of `input_len` (± range_ratio) random ids: the
    instruction's ids `head_ids`, the text, then `tail_ids`."""
    texts = random_requests(token_pool, num_prompts, input_len, output_len, range_ratio, seed)
    return [BenchRequest(head_ids + r.prompt_ids + tail_ids, r.output_len) for r in texts]


def arrival_gaps(num_requests: int, request_rate: float, seed: int = 0) -> list[float]:
    """Seconds to wait before sending each request: a Poisson process of `request_rate`
    requests/s (exponential gaps), or all zeros for an infinite rate (all at once)."""
    if request_rate <= 0:
        raise ValueError(f"request_rate={request_rate} must be > 0 (inf: all at once)")
    if math.isinf(request_rate):
        return [0.0] * num_requests
    rng = np.random.default_rng(seed)
    return rng.exponential(1.0 / request_rate, size=num_requests).tolist()

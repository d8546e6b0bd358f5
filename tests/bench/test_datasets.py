"""Workload generation of `conveyor bench`: lengths, seeds, shared prefixes, arrivals."""

import math

import numpy as np
import pytest

from services.bench.datasets import (
    arrival_gaps,
    prefix_requests,
    random_requests,
    repeat_requests,
)
from services.bench.run import Workload
from services.scheduler.speculative import propose_ngram

POOL = list(range(100, 400))


def test_random_requests_exact_lengths_without_range_ratio():
    requests = random_requests(POOL, 20, input_len=32, output_len=7, seed=1)
    assert len(requests) == 20
    assert all(len(r.prompt_ids) == 32 and r.output_len == 7 for r in requests)
    assert all(set(r.prompt_ids) <= set(POOL) for r in requests)


def test_random_requests_lengths_within_range_ratio():
    requests = random_requests(POOL, 200, input_len=100, output_len=50, range_ratio=0.5, seed=2)
    input_lens = [len(r.prompt_ids) for r in requests]
    output_lens = [r.output_len for r in requests]
    assert min(input_lens) >= 50 and max(input_lens) <= 150 and len(set(input_lens)) > 10
    assert min(output_lens) >= 25 and max(output_lens) <= 75


def test_random_requests_same_seed_same_prompts_other_seed_other_prompts():
    a = random_requests(POOL, 5, 16, 4, seed=3)
    b = random_requests(POOL, 5, 16, 4, seed=3)
    c = random_requests(POOL, 5, 16, 4, seed=4)
    assert [r.prompt_ids for r in a] == [r.prompt_ids for r in b]
    assert [r.prompt_ids for r in a] != [r.prompt_ids for r in c]


def test_random_requests_bad_arguments_are_named():
    with pytest.raises(ValueError, match="range_ratio"):
        random_requests(POOL, 1, 8, 8, range_ratio=1.5)
    with pytest.raises(ValueError, match="token_pool"):
        random_requests([], 1, 8, 8)


def test_prefix_requests_share_prefixes_in_turn():
    requests = prefix_requests(
        POOL, 6, prefix_len=24, input_len=8, output_len=4, num_prefixes=2, seed=5
    )
    assert all(len(r.prompt_ids) == 32 for r in requests)
    prefixes = [tuple(r.prompt_ids[:24]) for r in requests]
    assert prefixes[0] == prefixes[2] == prefixes[4] != prefixes[1] == prefixes[3] == prefixes[5]
    assert len({tuple(r.prompt_ids[24:]) for r in requests}) == 6  # own suffixes


def test_repeat_requests_wrap_a_text_in_the_instruction_and_lookup_finds_it():
    head, tail = [1, 2, 3], [4, 5]
    requests = repeat_requests(POOL, 4, 24, 30, head, tail, seed=6)
    texts = random_requests(POOL, 4, 24, 30, seed=6)
    for request, text in zip(requests, texts, strict=True):
        assert request.prompt_ids == head + text.prompt_ids + tail
        assert request.output_len == 30
        # Once the output starts copying the text, prompt lookup proposes the rest of it.
        copied = request.prompt_ids + text.prompt_ids[:3]
        assert propose_ngram(copied, 4, 3, 1) == text.prompt_ids[3:7]
    workload = Workload(dataset="repeat", num_prompts=2, input_len=8, output_len=4)
    built = workload.build(POOL, (head, tail))
    assert [r.prompt_ids[:3] for r in built] == [head, head]


def test_arrival_gaps_infinite_rate_sends_all_at_once():
    assert arrival_gaps(5, math.inf) == [0.0] * 5


def test_arrival_gaps_poisson_is_seeded_with_the_rate_as_mean():
    gaps = arrival_gaps(20_000, request_rate=4.0, seed=7)
    assert gaps[:10] == arrival_gaps(10, request_rate=4.0, seed=7)
    assert np.mean(gaps) == pytest.approx(0.25, rel=0.03)
    assert np.std(gaps) == pytest.approx(0.25, rel=0.05)  # exponential: std == mean
    with pytest.raises(ValueError, match="request_rate"):
        arrival_gaps(1, 0.0)

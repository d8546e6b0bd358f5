"""Speculative decoding on SmolLM2 through real worker processes, gloo, gRPC and Redis.

`conveyor scheduler --speculative-config` (n-gram) over 2 stages: greedy tokens equal
Hugging Face's (as without speculation), proposals were made and accepted, GetStats reports
them, and every KV block is free at the end.
"""

from __future__ import annotations

import json

import pytest

from tests.integration.utils import ProcessStack
from tests.worker.utils import compare_greedy

pytestmark = pytest.mark.slow

TIE_MARGIN = 0.01
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}


@pytest.mark.parametrize("scheduling", ["async"])
def test_speculative_stack_greedy_equals_transformers(
    smollm2_dir, smollm2_prompts, smollm2_reference, scheduling
):
    ref_tokens, ref_logits = smollm2_reference
    stack = ProcessStack(
        smollm2_dir, 2, scheduling, scheduler_args=["--speculative-config", json.dumps(SPEC)]
    ).start()
    try:
        greedy = [dict(max_tokens=16, ignore_eos=True)] * len(smollm2_prompts)
        outcomes = stack.generate_many(smollm2_prompts, greedy)
        stats = stack.stats()
    finally:
        stack.stop()
    flips = []
    for i, outcome in enumerate(outcomes):
        assert len(outcome.token_ids) == 16
        matched = compare_greedy(outcome.token_ids, ref_tokens[i], ref_logits[i], TIE_MARGIN)
        if matched < 16:
            flips.append((i, matched))
    assert len(flips) <= 2, f"too many near-tie flips: {flips}"
    assert json.loads(stats.speculative_config)["num_speculative_tokens"] == 4
    assert stats.num_spec_steps > 0 and stats.num_spec_accepted_tokens > 0
    assert 0 < stats.spec_acceptance_rate <= 1
    assert stats.spec_mean_accepted_length > 1
    assert stats.kv_usage == 0.0, "blocks still held after every request ended"

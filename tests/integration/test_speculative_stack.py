"""Speculative decoding on SmolLM2 through real worker processes, gloo, gRPC and Redis.

`conveyor scheduler --speculative-config` (n-gram, and SmolLM2 as its own draft model in a
`conveyor worker --draft` process) over 2 stages: greedy tokens equal Hugging Face's (as
without speculation), proposals were made and accepted, GetStats reports them, and every KV
block is free at the end. A draft worker killed between two batches stops nothing.
"""

from __future__ import annotations

import json

import pytest

from services.common.redis_server import free_port
from services.launcher import wait_serving
from tests.integration.utils import ProcessStack, _kill, _spawn
from tests.worker.utils import assert_greedy_matches

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
    assert_greedy_matches(outcomes, ref_tokens, ref_logits, 16, TIE_MARGIN)
    assert json.loads(stats.speculative_config)["num_speculative_tokens"] == 4
    assert stats.num_spec_steps > 0 and stats.num_spec_accepted_tokens > 0
    assert 0 < stats.spec_acceptance_rate <= 1
    assert stats.spec_mean_accepted_length > 1
    assert stats.kv_usage == 0.0, "blocks still held after every request ended"


def test_draft_model_stack_greedy_equals_transformers_and_survives_the_draft_worker(
    smollm2_dir, smollm2_prompts, smollm2_reference
):
    """SmolLM2 drafts for itself: greedy acceptance is (nearly) total, an upper bound."""
    ref_tokens, ref_logits = smollm2_reference
    port = free_port()
    draft = _spawn(
        ["worker", "--draft", "--model", str(smollm2_dir), "--port", str(port)]
        + ["--kv-cache-memory", "64MiB", "--threads", "1", "--max-model-len", "1024"]
    )
    # A generous deadline: on a loaded machine a first call (the prompts whole) may take
    # seconds, and a timed-out call counts as a failure (speculation itself is unaffected).
    spec = json.dumps(
        {"model": str(smollm2_dir), "num_speculative_tokens": 4, "draft_timeout_s": 60}
    )
    args = ["--speculative-config", spec, "--draft-worker", f"127.0.0.1:{port}"]
    stack = ProcessStack(smollm2_dir, 2, "async", scheduler_args=args)
    try:
        wait_serving(f"127.0.0.1:{port}", 180, draft)
        stack.start()
        greedy = [dict(max_tokens=16, ignore_eos=True)] * len(smollm2_prompts)
        outcomes = stack.generate_many(smollm2_prompts, greedy)
        stats = stack.stats()
        _kill(draft)  # the draft worker dies: the next batch runs without proposals
        again = stack.generate_many(smollm2_prompts, greedy)
        after = stack.stats()
    finally:
        _kill(draft)
        stack.stop()
    assert_greedy_matches(outcomes, ref_tokens, ref_logits, 16, TIE_MARGIN)
    assert_greedy_matches(again, ref_tokens, ref_logits, 16, TIE_MARGIN)
    assert stats.num_draft_calls > 0 and stats.num_draft_failures == 0
    assert stats.spec_acceptance_rate > 0.9, stats
    assert stats.spec_mean_accepted_length > 3
    assert after.num_draft_failures > 0 and after.draft_problem
    assert after.kv_usage == 0.0, "blocks still held after every request ended"

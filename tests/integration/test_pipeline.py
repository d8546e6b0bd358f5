"""The distributed pipeline on SmolLM2: real worker processes, gloo, gRPC and Redis.

Greedy output equals Hugging Face for 1, 2 and 3 stages in both scheduling modes, and seeded
sampling gives identical tokens in every mode (one seeded request with min_tokens: EOS masked).
"""

from __future__ import annotations

import pytest

from tests.integration.utils import ProcessStack
from tests.worker.utils import assert_greedy_matches

pytestmark = pytest.mark.slow

TIE_MARGIN = 0.01
SEEDED = [
    dict(temperature=0.8, top_p=0.95, seed=1000 + i, max_tokens=12, ignore_eos=True)
    for i in range(3)
] + [dict(temperature=0.8, top_p=0.95, seed=1003, max_tokens=12, min_tokens=12)]  # EOS masked
MODES = [(1, "async"), (2, "sync"), (2, "async"), (3, "sync"), (3, "async")]


@pytest.fixture(scope="module")
def run_mode(smollm2_dir, smollm2_prompts):
    """run_mode(stages, scheduling): the outcomes of the greedy prompts, then of the seeded
    ones, from one stack of that shape (started once per module and mode)."""
    outcomes: dict[tuple[int, str], list] = {}

    def run(stages: int, scheduling: str) -> list:
        if (stages, scheduling) not in outcomes:
            stack = ProcessStack(smollm2_dir, stages, scheduling).start()
            try:
                greedy = [dict(max_tokens=16, ignore_eos=True)] * len(smollm2_prompts)
                prompts = smollm2_prompts + smollm2_prompts[:4]
                outcomes[(stages, scheduling)] = stack.generate_many(prompts, greedy + SEEDED)
                assert stack.stats().kv_usage == 0.0, "blocks still held after every request ended"
            finally:
                stack.stop()
        return outcomes[(stages, scheduling)]

    return run


@pytest.mark.parametrize("stages,scheduling", MODES)
def test_pipeline_greedy_equals_transformers(
    run_mode, smollm2_prompts, smollm2_reference, stages, scheduling
):
    ref_tokens, ref_logits = smollm2_reference
    outcomes = run_mode(stages, scheduling)[: len(smollm2_prompts)]
    assert_greedy_matches(outcomes, ref_tokens, ref_logits, 16, TIE_MARGIN)


def test_pipeline_seeded_sampling_identical_in_every_mode(run_mode, smollm2_prompts):
    seeded = {mode: run_mode(*mode)[len(smollm2_prompts) :] for mode in MODES}
    seeded = {mode: [o.token_ids for o in outcomes] for mode, outcomes in seeded.items()}
    (first_mode, first), *rest = seeded.items()
    assert all(len(t) == 12 for t in first)
    for mode, tokens in rest:
        assert tokens == first, f"seeded sampling differs between {first_mode} and {mode}"

"""SmolLM2-135M, real weights: the runner's greedy tokens equal transformers'.

Select with `pytest -m smollm2`. Where HF's own top-2 logits are a near-tie (margin below
TIE_MARGIN) a flip to HF's second choice is accepted, and that prompt is compared only up
to the flip (fp32 summation order differs between the two implementations).
"""

from __future__ import annotations

import pytest
import torch

from tests.worker.utils import TinyPlanner, compare_greedy, hf_greedy, make_runners, run_plans

pytestmark = pytest.mark.smollm2

NUM_NEW = 32
TIE_MARGIN = 0.01
LOGIT_ATOL = 2e-3
TEXTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea, there lived",
    "The three primary colors are",
    "To make a cup of tea, first",
    "Water boils at",
    "1, 2, 3, 4, 5,",
    "The quick brown fox",
]


@pytest.fixture(scope="module")
def prompts(smollm2_dir):
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(smollm2_dir / "tokenizer.json"))
    return [tokenizer.encode(text).ids for text in TEXTS]


@pytest.fixture(scope="module")
def reference(smollm2_dir, prompts):
    torch.set_num_threads(2)
    return hf_greedy(smollm2_dir, prompts, NUM_NEW, use_cache=True)


@pytest.mark.parametrize(
    ("num_stages", "chunk_size", "fast_cpu"), [(1, None, False), (3, 4, False), (2, 8, True)]
)
def test_smollm2_greedy_equals_transformers(
    smollm2_dir, prompts, reference, num_stages, chunk_size, fast_cpu
):
    """fast_cpu: oneDNN matmuls and the C++ decode attention, as a CPU worker runs them."""
    ref_tokens, ref_logits = reference
    runners = make_runners(
        smollm2_dir,
        num_stages,
        block_size=16,
        num_blocks=64,
        attention_backend="cpu" if fast_cpu else "torch",
        onednn=fast_cpu,
    )
    planner = TinyPlanner(16, 64, chunk_size=chunk_size, shuffle_seed=7)
    for i, prompt in enumerate(prompts):
        planner.add(f"req-{i}", prompt, NUM_NEW, arrival_step=i // 2)
    outputs = run_plans(planner, runners)
    flips = []
    for i in range(len(prompts)):
        matched = compare_greedy(outputs[f"req-{i}"], ref_tokens[i], ref_logits[i], TIE_MARGIN)
        if matched < NUM_NEW:
            flips.append((i, matched))
        for step in range(matched):
            torch.testing.assert_close(
                planner.logits[f"req-{i}"][step], ref_logits[i][step], atol=LOGIT_ATOL, rtol=0
            )
    assert len(flips) <= 2, f"too many near-tie flips (prompt, token): {flips}"
    if flips:
        print(f"accepted near-tie flips (prompt, token): {flips}")

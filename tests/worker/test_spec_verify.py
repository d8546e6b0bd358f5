"""The last stage's verification of proposed tokens (services/worker/runner.py).

Greedy: exactly the tokens of plain decoding. Sampling: the first token a speculative step
yields is distributed as the model's next-token distribution p0 (not pulled towards the
proposal), and after an accepted proposal the next one follows p1 — a chi-square test
against the exact probabilities, over 3000 requests sampled in one batch on a tiny random
model (the sampler's global generator is seeded, so the test is deterministic).
"""

from __future__ import annotations

import pytest
import torch

from services.common.sampling import SamplingParams
from services.common.step import CachedRequest, NewRequest, StepPlan
from services.models.tiny import make_tiny_model
from services.worker.runner import accept_proposal
from services.worker.sampler import Sampler
from tests.worker.utils import make_runners

PROMPT = [11, 42, 7, 99, 250, 31, 8, 77, 140, 5]
NUM_REQUESTS = 3000
TOP_K = 4
TEMPERATURE = 0.1  # sharpens the tiny model's near-uniform top-4 into an uneven law
CHI2_CRITICAL_DF3 = 16.27  # p = 0.001 for 3 degrees of freedom (TOP_K - 1)


def test_accept_proposal_keeps_the_agreeing_prefix_and_one_more():
    assert accept_proposal([5], []) == [5]
    assert accept_proposal([1, 2, 3], [1, 2]) == [1, 2, 3]
    assert accept_proposal([1, 9, 3], [1, 2]) == [1, 9]
    assert accept_proposal([8, 2, 3], [1, 2]) == [8]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("verify") / "tiny", tie_word_embeddings=False)


def _steps(sampling: SamplingParams, num: int, spec: list[int]):
    """Prefill all but the last prompt token (nothing sampled), then one step of the last
    prompt token with `spec` proposed (one block per request)."""
    prefill = StepPlan(
        0,
        new_requests=[
            NewRequest(f"r{i}", PROMPT, len(PROMPT), sampling, [i], 0, len(PROMPT) - 1)
            for i in range(num)
        ],
    )
    verify = StepPlan(
        1, cached_requests=[CachedRequest(f"r{i}", 1, [], [], spec) for i in range(num)]
    )
    return prefill, verify


def _emitted(result) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for request_id, token_id in zip(result.request_ids, result.token_ids, strict=True):
        out.setdefault(request_id, []).append(token_id)
    return out


def _chi2(samples: list[int], logits: torch.Tensor) -> float:
    """Chi-square statistic of `samples` against softmax over the top-k of `logits`."""
    top = logits.topk(TOP_K)
    probs = (top.values / TEMPERATURE).softmax(-1)
    counts = torch.tensor([samples.count(t) for t in top.indices.tolist()], dtype=torch.float64)
    assert int(counts.sum()) == len(samples), "a sample outside the top-k"
    expected = probs.double() * len(samples)
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_verify_greedy_equals_plain_decoding(model_dir, backend):
    """On the torch paths and on a CPU worker's (the C++ kernels: decode rows, and the k + 1
    rows of a speculative step on attention/cpu_backend.py's chunk kernel)."""
    greedy = SamplingParams(max_tokens=8, ignore_eos=True)
    options = {"attention_backend": backend, "onednn": backend == "cpu"}
    (runner,) = make_runners(model_dir, 1, num_blocks=4, **options)
    prefill, step = _steps(greedy, 1, [])
    runner.execute(prefill)
    plain = []
    for step_id in range(1, 5):
        result = runner.execute(
            step if step_id == 1 else StepPlan(step_id, cached_requests=[CachedRequest("r0", 1)])
        )
        plain.extend(result.token_ids)
    for spec, num_accepted in ((plain[:3], 3), ([plain[0], plain[1] + 1, 3], 1), ([7, 7], 0)):
        (runner,) = make_runners(model_dir, 1, num_blocks=4, **options)
        prefill, step = _steps(greedy, 1, spec)
        runner.execute(prefill)
        result = runner.execute(step)
        assert result.token_ids == plain[: num_accepted + 1]
        assert runner.requests["r0"].num_computed_tokens == len(PROMPT) + num_accepted


def test_verify_sampled_tokens_follow_the_model_not_the_proposal(model_dir):
    sampling = SamplingParams(max_tokens=8, ignore_eos=True, temperature=TEMPERATURE, top_k=TOP_K)
    (runner,) = make_runners(model_dir, 1, num_blocks=NUM_REQUESTS)
    runner.sampler = Sampler(seed=1234)
    # The proposal: the most likely next token, then the most likely one after it.
    (probe,) = make_runners(model_dir, 1, num_blocks=2)
    greedy = SamplingParams(max_tokens=8, ignore_eos=True)
    prefill, step = _steps(greedy, 1, [])
    probe.execute(prefill)
    first = probe.execute(step).token_ids[0]
    second = probe.execute(StepPlan(2, cached_requests=[CachedRequest("r0", 1)])).token_ids[0]
    spec = [first, second]

    prefill, step = _steps(sampling, NUM_REQUESTS, spec)
    runner.execute(prefill)
    emitted = _emitted(runner.execute(step))
    logits = runner.last_logits.view(NUM_REQUESTS, len(spec) + 1, -1)[0]  # same context each
    x0 = [tokens[0] for tokens in emitted.values()]
    after_first = [tokens[1] for tokens in emitted.values() if tokens[0] == first]
    num_accepted = sum(len(tokens) - 1 for tokens in emitted.values())
    assert 0 < len(after_first) < NUM_REQUESTS, "the proposal was always or never accepted"
    assert num_accepted > len(after_first)  # some accepted both
    assert _chi2(x0, logits[0]) < CHI2_CRITICAL_DF3
    assert _chi2(after_first, logits[1]) < CHI2_CRITICAL_DF3
    # Against a wrong law (the proposal always kept when p says so half the time) it fails:
    assert _chi2([first] * len(x0), logits[0]) > CHI2_CRITICAL_DF3

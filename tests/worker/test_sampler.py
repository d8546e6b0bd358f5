"""Sampler: greedy, temperature, truncation, penalties, per-request seeds, logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from services.common.sampling import SamplingParams
from services.worker.sampler import Sampler, SamplingBatch, argmax_rows

# Probabilities of a 4-token vocabulary used by the truncation tests.
FOUR_PROBS = [0.5, 0.3, 0.15, 0.05]


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    prompts: list[list[int]] | None = None,
    outputs: list[list[int]] | None = None,
    sampler: Sampler | None = None,
):
    """Run one sampler step on `logits` [N, V]; prompts/outputs default to empty."""
    prompts = prompts if prompts is not None else [[] for _ in params]
    outputs = outputs if outputs is not None else [[] for _ in params]
    batch = SamplingBatch.from_requests(params, prompts, outputs)
    return (sampler or Sampler(seed=0))(logits, batch)


def repeated_rows(row: list[float], num_rows: int) -> torch.Tensor:
    return torch.tensor([row], dtype=torch.float32).repeat(num_rows, 1)  # [num_rows, V]


def sampled_set(row: list[float], params: SamplingParams, num_draws: int = 2000) -> set[int]:
    """The distinct tokens drawn from `row` over many unseeded rows of one batch."""
    out = sample(repeated_rows(row, num_draws), [params] * num_draws)
    return set(out.token_ids.tolist())


def entropy(token_ids: list[int]) -> float:
    counts = torch.bincount(torch.tensor(token_ids)).float()
    p = counts[counts > 0] / counts.sum()
    return float(-(p * p.log()).sum())


def test_argmax_rows_matches_torch_argmax_on_ties_nan_and_infinities():
    nan, inf = float("nan"), float("inf")
    x = torch.tensor(
        [
            [1.0, 3.0, 3.0, 2.0],  # a tie: the first maximum
            [1.0, nan, 3.0, nan],  # NaN counts as the maximum
            [-inf, -inf, -inf, -inf],
            [inf, 1.0, inf, 0.0],
            [0.0, -0.0, -1.0, -2.0],
        ]
    )
    wide = torch.randn(7, 49152)
    wide[3, 100] = wide[3, 200] = wide[3].max() + 1  # a tie in a long row
    wide[4, 49150] = nan  # past the vector loops' last full block
    wide[5, 49151] = wide[5].max() + 1
    wide[6, 40000:] = inf
    cases = (x, wide, wide[:, ::3], wide.t().contiguous().t(), wide[:, :49147], x[:0])
    for logits in (*cases, *(case.bfloat16() for case in cases)):
        got = argmax_rows(logits)  # bfloat16: as the greedy path reads a bf16 model's logits
        assert got.dtype == torch.int64
        assert torch.equal(got, logits.argmax(dim=-1)), (logits.shape, logits.dtype)


def test_sampler_greedy_takes_argmax():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(1))
    out = sample(logits, [SamplingParams()] * 6)
    assert out.token_ids.tolist() == logits.argmax(dim=-1).tolist()
    assert out.token_ids.dtype == torch.int64
    assert out.logprobs is None


def test_sampler_does_not_modify_logits():
    logits = torch.randn(3, 20, generator=torch.Generator().manual_seed(2))
    before = logits.clone()
    params = [SamplingParams(temperature=0.7, top_k=5, top_p=0.8, repetition_penalty=1.5)] * 3
    sample(logits, params, prompts=[[1, 2, 3]] * 3, outputs=[[4, 4]] * 3)
    assert torch.equal(logits, before)


def test_sampler_higher_temperature_spreads_samples():
    row = torch.linspace(0.0, 4.0, 20).tolist()
    cold = sample(repeated_rows(row, 2000), [SamplingParams(temperature=0.2)] * 2000)
    hot = sample(repeated_rows(row, 2000), [SamplingParams(temperature=2.0)] * 2000)
    cold_entropy, hot_entropy = entropy(cold.token_ids.tolist()), entropy(hot.token_ids.tolist())
    # exact entropies: 0.99 nats at T=0.2, 2.83 nats at T=2.0
    assert 0.7 < cold_entropy < 1.3
    assert 2.5 < hot_entropy < 3.1


def test_sampler_top_k_1_equals_greedy():
    logits = torch.randn(64, 100, generator=torch.Generator().manual_seed(3))
    params = [SamplingParams(temperature=1.5, top_k=1, seed=i) for i in range(64)]
    out = sample(logits, params)
    assert out.token_ids.tolist() == logits.argmax(dim=-1).tolist()


def test_sampler_top_k_samples_only_the_top_k():
    row = torch.randn(40, generator=torch.Generator().manual_seed(4)).tolist()
    top3 = set(torch.tensor(row).topk(3).indices.tolist())
    assert sampled_set(row, SamplingParams(temperature=5.0, top_k=3)) == top3


def test_sampler_small_top_p_samples_only_the_top_token():
    row = [math.log(p) for p in FOUR_PROBS]
    assert sampled_set(row, SamplingParams(temperature=1.0, top_p=0.05)) == {0}


def test_sampler_top_p_keeps_to_the_nucleus():
    # 0.5 + 0.3 < 0.9 <= 0.5 + 0.3 + 0.15: the nucleus is tokens {0, 1, 2}
    row = [math.log(p) for p in FOUR_PROBS]
    assert sampled_set(row, SamplingParams(temperature=1.0, top_p=0.9)) == {0, 1, 2}
    assert sampled_set(row, SamplingParams(temperature=1.0)) == {0, 1, 2, 3}


def test_sampler_min_p_excludes_unlikely_tokens():
    # threshold 0.2 * 0.5 = 0.1 drops token 3 (0.05) only
    row = [math.log(p) for p in FOUR_PROBS]
    assert sampled_set(row, SamplingParams(temperature=1.0, min_p=0.2)) == {0, 1, 2}


def test_sampler_repetition_penalty_moves_greedy_off_a_seen_token():
    row = [0.0, 0.5, 1.5, 2.0, -1.0]
    params = [SamplingParams(), SamplingParams(repetition_penalty=2.0)] * 2
    out = sample(repeated_rows(row, 4), params, prompts=[[3], [3], [0], [0]], outputs=[[]] * 4)
    # token 3 seen in the prompt: 2.0 / 2 = 1.0 < 1.5; unseen token 3 stays on top
    assert out.token_ids.tolist() == [3, 2, 3, 3]
    # a seen token in the output is penalised too
    out = sample(repeated_rows(row, 1), [SamplingParams(repetition_penalty=2.0)], outputs=[[3]])
    assert out.token_ids.tolist() == [2]


def test_sampler_repetition_penalty_multiplies_negative_logits():
    row = [-1.0, -1.2, -5.0]
    params = [SamplingParams(repetition_penalty=1.5)]
    # -1.0 * 1.5 = -1.5 < -1.2: dividing a negative logit would have raised it instead
    assert sample(repeated_rows(row, 1), params, prompts=[[0]]).token_ids.tolist() == [1]


def test_sampler_presence_penalty_counts_output_tokens_only():
    row = [3.0, 2.0, 0.0]
    params = [SamplingParams(presence_penalty=1.5)] * 2
    out = sample(repeated_rows(row, 2), params, prompts=[[0, 0], []], outputs=[[], [0]])
    assert out.token_ids.tolist() == [0, 1]


def test_sampler_frequency_penalty_scales_with_count():
    row = [3.0, 2.0, 0.0]
    params = [SamplingParams(frequency_penalty=0.6)] * 3
    outputs = [[0], [0, 0], []]
    # 3 - 0.6 = 2.4 stays above 2; 3 - 1.2 = 1.8 drops below; in the prompt only: no effect
    out = sample(repeated_rows(row, 3), params, prompts=[[], [], [0, 0, 0]], outputs=outputs)
    assert out.token_ids.tolist() == [0, 1, 0]


def _seeded_sequence(
    seed: int, position: int | None, num_steps: int, sampler: Sampler
) -> list[int]:
    """Decode `num_steps` tokens of one seeded request at `position` of a batch of 16.

    `position` None runs the request alone.
    The other rows mix greedy, unseeded and seeded requests using every sampling feature, so
    the batch takes all of its slow paths while the request under test uses none of them.
    """
    others = [
        SamplingParams(),
        SamplingParams(temperature=0.8, top_k=5),
        SamplingParams(temperature=1.2, top_p=0.7, seed=99),
        SamplingParams(temperature=0.5, min_p=0.1, repetition_penalty=1.3),
        SamplingParams(temperature=1.0, presence_penalty=0.5, frequency_penalty=0.4),
    ]
    request = SamplingParams(temperature=1.0, seed=seed)
    if position is None:
        params, position = [request], 0
    else:
        params = [others[i % len(others)] for i in range(15)]
        params.insert(position, request)
    num_rows = len(params)
    tokens: list[int] = []
    for step in range(num_steps):
        logits = torch.randn(num_rows, 64, generator=torch.Generator().manual_seed(100 + step))
        logits[position] = torch.randn(64, generator=torch.Generator().manual_seed(step))
        outputs = [list(tokens) if i == position else [1, 2] * step for i in range(num_rows)]
        out = sample(logits, params, prompts=[[5, 6]] * num_rows, outputs=outputs, sampler=sampler)
        tokens.append(int(out.token_ids[position]))
    return tokens


def test_sampler_seeded_request_ignores_the_rest_of_the_batch():
    alone = _seeded_sequence(seed=7, position=None, num_steps=12, sampler=Sampler(seed=0))
    assert len(set(alone)) > 3  # really sampled, not greedy
    for position, global_seed in [(0, 1), (7, 2), (15, None)]:
        sampler = Sampler(seed=global_seed)
        assert _seeded_sequence(7, position, 12, sampler) == alone


def test_sampler_seeded_token_depends_only_on_seed_and_position():
    # a recompute after preemption resumes at k = len(outputs) in a fresh process
    alone = _seeded_sequence(seed=7, position=None, num_steps=6, sampler=Sampler(seed=0))
    logits = torch.randn(1, 64, generator=torch.Generator().manual_seed(5))
    out = sample(
        logits, [SamplingParams(temperature=1.0, seed=7)], outputs=[alone[:5]], sampler=Sampler()
    )
    assert out.token_ids.tolist() == [alone[5]]


def test_sampler_seeded_request_draws_fresh_noise_each_position():
    # identical logits at every step: only the position k can make the tokens differ
    logits = torch.zeros(1, 64)
    params = [SamplingParams(temperature=1.0, seed=11)]
    tokens: list[int] = []
    for _ in range(20):
        tokens.append(int(sample(logits, params, outputs=[list(tokens)]).token_ids[0]))
    assert len(set(tokens)) > 5


def test_sampler_different_seeds_give_different_tokens():
    first = _seeded_sequence(seed=1, position=None, num_steps=12, sampler=Sampler(seed=0))
    second = _seeded_sequence(seed=2, position=None, num_steps=12, sampler=Sampler(seed=0))
    assert first != second


def test_sampler_logprobs_are_sorted_raw_log_softmax():
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(6))
    params = [
        SamplingParams(logprobs=5),
        SamplingParams(temperature=1.0, seed=3, logprobs=2, repetition_penalty=1.8),
        SamplingParams(temperature=1.0),
        SamplingParams(logprobs=0),
    ]
    out = sample(logits, params, prompts=[[1, 2]] * 4)
    raw = logits.log_softmax(dim=-1)
    assert out.logprobs is not None and out.logprobs[2] is None
    for row, n in [(0, 5), (1, 2), (3, 0)]:
        entry = out.logprobs[row]
        assert entry is not None and len(entry.top_token_ids) == n == len(entry.top_logprobs)
        assert entry.top_logprobs == sorted(entry.top_logprobs, reverse=True)
        assert entry.top_token_ids == raw[row].topk(n).indices.tolist()
        assert entry.top_logprobs == pytest.approx(raw[row].topk(n).values.tolist())
        sampled = int(out.token_ids[row])
        assert entry.token_logprob == pytest.approx(float(raw[row, sampled]))


def test_sampler_mixed_batch_keeps_greedy_rows_greedy():
    logits = torch.randn(200, 16, generator=torch.Generator().manual_seed(8)) * 0.1
    params = [SamplingParams() if i % 2 else SamplingParams(temperature=2.0) for i in range(200)]
    out = sample(logits, params)
    argmax = logits.argmax(dim=-1)
    assert torch.equal(out.token_ids[1::2], argmax[1::2])
    # near-flat logits at T=2: random rows leave the argmax most of the time
    assert (out.token_ids[0::2] != argmax[0::2]).float().mean() > 0.5


def test_sampling_batch_rejects_mismatched_lengths():
    with pytest.raises(ValueError, match="one entry per request"):
        SamplingBatch.from_requests([SamplingParams()] * 2, [[1]], [[], []])


def test_sampler_rejects_logits_of_another_batch_size():
    batch = SamplingBatch.from_requests([SamplingParams()] * 2, [[1], [2]], [[], []])
    with pytest.raises(ValueError, match="do not match a batch of 2"):
        Sampler()(torch.zeros(3, 10), batch)


def test_sampler_masks_eos_and_stop_token_ids_until_min_tokens():
    logits = torch.tensor([[0.0, 1.0, 5.0, 4.0, 3.0]]).repeat(4, 1)  # EOS (2) is the argmax
    params = [
        SamplingParams(min_tokens=2, stop_token_ids=[3]),  # under min_tokens: 2, 3 masked
        SamplingParams(min_tokens=2, stop_token_ids=[3]),  # output reached min_tokens
        SamplingParams(min_tokens=2, ignore_eos=True),  # EOS not a stop: stays
        SamplingParams(),  # no min_tokens: untouched
    ]
    outputs = [[1], [1, 1], [], []]
    batch = SamplingBatch.from_requests(params, [[]] * 4, outputs, eos_token_ids=[2])
    out = Sampler(seed=0)(logits, batch)
    assert out.token_ids.tolist() == [4, 2, 2, 2]
    # seeded random rows never draw a masked token either
    hot = torch.tensor([[0.0, 0.0, 9.0, 9.0, 0.0]]).repeat(64, 1)
    seeded = [
        SamplingParams(temperature=1.0, seed=i, min_tokens=1, stop_token_ids=[3]) for i in range(64)
    ]
    batch = SamplingBatch.from_requests(seeded, [[]] * 64, [[]] * 64, eos_token_ids=[2])
    drawn = set(Sampler()(hot, batch).token_ids.tolist())
    assert drawn and not drawn & {2, 3}


def test_sampler_masks_every_eos_id_until_min_tokens():
    # Two EOS ids (Llama 3's generation_config lists several): neither may end the request
    # before min_tokens, whichever of them the model likes best.
    logits = torch.tensor([[0.0, 1.0, 5.0, 4.0, 3.0]]).repeat(2, 1)
    params = [SamplingParams(min_tokens=1), SamplingParams()]
    batch = SamplingBatch.from_requests(params, [[]] * 2, [[]] * 2, eos_token_ids=[2, 3])
    assert Sampler(seed=0)(logits, batch).token_ids.tolist() == [4, 2]


def test_sampler_min_tokens_keeps_raw_logprobs():
    logits = torch.tensor([[0.0, 1.0, 5.0]])
    params = [SamplingParams(min_tokens=1, logprobs=1)]
    batch = SamplingBatch.from_requests(params, [[]], [[]], eos_token_ids=[2])
    out = Sampler(seed=0)(logits, batch)
    assert out.token_ids.tolist() == [1]
    (lp,) = out.logprobs
    assert lp.top_token_ids == [2]  # the masked EOS is still the most likely, raw
    assert lp.token_logprob == pytest.approx(logits.log_softmax(-1)[0, 1].item())

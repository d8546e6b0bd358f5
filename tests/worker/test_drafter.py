"""The draft worker's core (services/worker/draft.py) on a tiny random Llama: its proposals
are the model's greedy continuation (Hugging Face's), whether it computes a request from
scratch, from the tokens new since its last call, after the target rejected some of its
drafts, or after it evicted the request for room."""

from __future__ import annotations

import pytest

from services.common.errors import ConfigError, InvalidRequest
from services.models.tiny import make_tiny_model
from services.worker.config import WorkerConfig
from services.worker.draft import Drafter, DraftSequence
from services.worker.runner import StageRunner
from tests.worker.utils import hf_greedy

K = 4
PROMPTS = [[11, 42, 7, 99, 250, 31, 8, 77, 140, 5], [3, 14, 15, 92, 65, 35, 89, 79]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("draft") / "tiny", num_layers=2)


def _drafter(model_dir, kv_cache_memory="4MiB") -> Drafter:
    config = WorkerConfig(
        str(model_dir), kv_cache_memory=kv_cache_memory, max_model_len=64, num_threads=1,
        block_size=8, is_draft=True,
    )  # fmt: skip
    return Drafter(StageRunner.from_config(config), 64)


def _greedy(model_dir, prompts, k=K) -> list[list[int]]:
    return hf_greedy(model_dir, prompts, k)[0]


def test_drafter_proposes_the_greedy_continuation_across_calls(model_dir):
    drafter = _drafter(model_dir)
    out = drafter.propose([DraftSequence(f"r{i}", 0, p, K) for i, p in enumerate(PROMPTS)], [])
    assert out.unknown_request_ids == []
    assert [out.proposals[f"r{i}"] for i in range(2)] == _greedy(model_dir, PROMPTS)

    # r0: the target accepted 2 drafts and then chose its own token; r1: accepted none.
    first = out.proposals["r0"]
    r0 = PROMPTS[0] + first[:2] + [(first[2] + 1) % 256]
    r1 = PROMPTS[1] + [(out.proposals["r1"][0] + 7) % 256]
    out = drafter.propose(
        [
            DraftSequence("r0", len(PROMPTS[0]), r0[len(PROMPTS[0]) :], 3),
            DraftSequence("r1", len(PROMPTS[1]), r1[len(PROMPTS[1]) :], K),
        ],
        [],
    )
    assert out.proposals["r0"] == _greedy(model_dir, [r0], 3)[0]
    assert out.proposals["r1"] == _greedy(model_dir, [r1])[0]

    drafter.propose([], ["r0"])  # finished: freed, so a later call with start > 0 is unknown
    out = drafter.propose([DraftSequence("r0", len(r0), [5], K)], [])
    assert out.unknown_request_ids == ["r0"] and out.proposals == {}
    assert drafter.num_requests == 1


def test_drafter_restarted_names_requests_to_send_whole(model_dir):
    out = _drafter(model_dir).propose([DraftSequence("r0", 10, [1, 2], K)], [])
    assert out.unknown_request_ids == ["r0"]


def test_drafter_evicts_requests_outside_the_batch_for_room(model_dir):
    # 8 blocks of 8 tokens: each 10-token prompt + 3 draft slots takes 2 blocks
    bytes_per_block = 2 * 2 * 8 * 2 * 16 * 4  # K and V, 2 layers, 8 tokens, 2 heads, dim 16
    drafter = _drafter(model_dir, str(8 * bytes_per_block))
    assert drafter.runner.kv_cache.num_blocks == 8
    prompts = [[i + 20, *PROMPTS[0][1:]] for i in range(6)]
    for i, prompt in enumerate(prompts):
        out = drafter.propose([DraftSequence(f"r{i}", 0, prompt, K)], [])
        assert out.proposals[f"r{i}"] == _greedy(model_dir, [prompt])[0]
    assert drafter.num_requests == 4  # the oldest two were evicted
    out = drafter.propose([DraftSequence("r0", len(prompts[0]), [9], K)], [])
    assert out.unknown_request_ids == ["r0"]
    out = drafter.propose([DraftSequence("r0", 0, prompts[0] + [9], K)], [])
    assert out.proposals["r0"] == _greedy(model_dir, [prompts[0] + [9]])[0]


def test_drafter_forgets_a_request_it_had_no_room_for(model_dir):
    """A held request skipped for room must not be extended later with its own old drafts
    in place of the tokens the target chose: it is named unknown (sent again whole)."""
    bytes_per_block = 2 * 2 * 8 * 2 * 16 * 4
    drafter = _drafter(model_dir, str(8 * bytes_per_block))  # 8 blocks of 8 tokens
    prompt = [*PROMPTS[0], 1, 2, 3]  # 13 tokens + 3 draft slots: 2 blocks
    drafts = drafter.propose([DraftSequence("a", 0, prompt, K)], []).proposals["a"]
    chosen = [(d + 1) % 256 for d in drafts[:3]]  # the target rejected every draft
    long = [(7 * i) % 256 + 1 for i in range(45)]  # 45 + 3 slots: the 6 other blocks
    out = drafter.propose(
        [DraftSequence("b", 0, long, K), DraftSequence("a", len(prompt), chosen, K)], []
    )
    assert "a" not in out.proposals  # 19 slots need a 3rd block: none left in this batch
    sequence = prompt + chosen + [9]
    out = drafter.propose([DraftSequence("a", len(prompt) + 3, [9], K)], ["b"])
    if "a" in out.proposals:  # its KV must be the target's tokens, not its own old drafts
        assert drafter.runner.requests["a"].token_ids[: len(sequence)] == sequence
        assert out.proposals["a"] == _greedy(model_dir, [sequence])[0]
    else:
        assert out.unknown_request_ids == ["a"]


@pytest.mark.parametrize(
    "sequences",
    [
        [DraftSequence("a", 0, [1, 2], 0)],
        [DraftSequence("a", 0, [1, 999], 2)],
        [DraftSequence("a", 0, [1], 2), DraftSequence("a", 0, [1], 2)],
    ],
)
def test_drafter_refuses_malformed_calls(model_dir, sequences):
    with pytest.raises(InvalidRequest):
        _drafter(model_dir).propose(sequences, [])


@pytest.mark.parametrize(
    "overrides", [{"num_stages": 2}, {"tensor_parallel_size": 2}, {"device": "sim"}]
)
def test_draft_worker_config_refuses_a_share_of_the_model(model_dir, overrides):
    with pytest.raises(ConfigError, match="--draft runs the whole draft model"):
        WorkerConfig(str(model_dir), is_draft=True, **overrides)

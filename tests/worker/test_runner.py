"""StageRunner against Hugging Face transformers: greedy tokens equal, logits close.

Every case runs 8 prompts of different lengths (3..40 tokens) together, 32 new tokens
each, arriving over the first steps so that prefill chunks and decodes share batches.
"""

from __future__ import annotations

import pytest
import torch

from services.common.errors import UnknownRequest
from services.common.sampling import SamplingParams
from services.common.step import CachedRequest, NewRequest, StepPlan
from tests.worker.utils import (
    LLAMA3_ROPE,
    TinyPlanner,
    compare_greedy,
    hf_greedy,
    make_prompts,
    make_runners,
    make_tiny_model,
    run_plans,
)

NUM_NEW = 32
LOGIT_ATOL = 1e-4  # fp32; observed differences are ~3e-6
TIE_MARGIN = 1e-4  # a flip to HF's 2nd choice is accepted only below this top-2 margin

MODELS = {
    "llama-gqa4": dict(arch="llama", num_kv_heads=1),
    "llama-gqa2-tied": dict(arch="llama", num_kv_heads=2, tied=True),
    "llama-mha": dict(arch="llama", num_kv_heads=4),
    "llama3-rope": dict(arch="llama", num_kv_heads=2, rope_scaling=LLAMA3_ROPE),
    "qwen2-bias": dict(arch="qwen2", num_kv_heads=2),
    "mistral-tied": dict(arch="mistral", num_kv_heads=1, tied=True),
}
_cache: dict[str, tuple] = {}


@pytest.fixture(scope="module", autouse=True)
def _threads():
    torch.set_num_threads(1)


def reference(name: str, tmp_path_factory) -> tuple:
    """(model_dir, prompts, HF tokens, HF logits), built once per model."""
    if name not in _cache:
        model_dir = make_tiny_model(tmp_path_factory.mktemp(name), **MODELS[name])
        prompts = make_prompts(8, seed=len(name))
        _cache[name] = (model_dir, prompts, *hf_greedy(model_dir, prompts, NUM_NEW))
    return _cache[name]


def run_and_compare(
    ref,
    num_stages=1,
    chunk_size=None,
    block_size=16,
    shuffle_seed=None,
    async_mode=False,
    fast_cpu=False,
) -> None:
    model_dir, prompts, ref_tokens, ref_logits = ref
    runners = make_runners(
        model_dir,
        num_stages,
        block_size,
        num_blocks=512 // block_size * 8,
        attention_backend="cpu" if fast_cpu else "torch",
        onednn=fast_cpu,
    )
    planner = TinyPlanner(block_size, 512 // block_size * 8, chunk_size, shuffle_seed, async_mode)
    for i, prompt in enumerate(prompts):
        planner.add(f"req-{i}", prompt, NUM_NEW, arrival_step=i // 3)
    outputs = run_plans(planner, runners)
    for i in range(len(prompts)):
        ours = outputs[f"req-{i}"]
        assert len(ours) == NUM_NEW
        matched = compare_greedy(ours, ref_tokens[i], ref_logits[i], TIE_MARGIN)
        for step in range(matched):
            torch.testing.assert_close(
                planner.logits[f"req-{i}"][step], ref_logits[i][step], atol=LOGIT_ATOL, rtol=0
            )
        assert matched == NUM_NEW, f"req-{i} flipped at a near-tie at token {matched}"


@pytest.mark.parametrize(
    ("name", "num_stages", "chunk_size"),
    [
        ("llama-gqa4", 1, None),
        ("llama-gqa4", 3, 5),
        ("llama-gqa2-tied", 2, 7),
        ("llama-gqa2-tied", 3, None),
        ("llama-mha", 3, 16),
        ("llama3-rope", 2, 4),
        ("qwen2-bias", 3, 6),
        ("mistral-tied", 1, 9),
    ],
)
def test_runner_greedy_equals_transformers(name, num_stages, chunk_size, tmp_path_factory):
    run_and_compare(reference(name, tmp_path_factory), num_stages, chunk_size)


@pytest.mark.parametrize(
    ("name", "num_stages", "chunk_size"),
    [("llama-gqa4", 3, 5), ("llama-mha", 1, None), ("qwen2-bias", 2, 6), ("mistral-tied", 1, 9)],
)
def test_runner_on_cpu_kernels_equals_transformers(name, num_stages, chunk_size, tmp_path_factory):
    """What a CPU worker runs: oneDNN matmuls and the C++ decode attention."""
    run_and_compare(reference(name, tmp_path_factory), num_stages, chunk_size, fast_cpu=True)


@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_runner_block_size_and_shuffled_blocks_do_not_change_tokens(block_size, tmp_path_factory):
    run_and_compare(
        reference("llama-gqa2-tied", tmp_path_factory),
        num_stages=2,
        chunk_size=11,
        block_size=block_size,
        shuffle_seed=block_size,
    )


def test_runner_async_mode_takes_decode_inputs_from_last_stage(tmp_path_factory):
    run_and_compare(
        reference("llama-gqa4", tmp_path_factory), num_stages=3, chunk_size=8, async_mode=True
    )


def test_runner_forgets_finished_requests(tmp_path):
    model_dir = make_tiny_model(tmp_path, num_layers=2)
    (runner,) = make_runners(model_dir)
    planner = TinyPlanner(16, 64)
    planner.add("a", [5, 6, 7], 2)
    run_plans(planner, [runner])
    runner.execute(planner.next_plan())  # carries the last finished id
    assert runner.requests == {}
    with pytest.raises(UnknownRequest, match="'a'"):
        runner.execute(StepPlan(99, cached_requests=[CachedRequest("a", 1, [], [9])]))


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        (NewRequest("a", [5, 10**6], 2, SamplingParams(), [0], 0, 2), "token id 1000000"),
        (NewRequest("a", [5, 6], 2, SamplingParams(), [128], 0, 2), "block id 128"),
        (CachedRequest("b", 1, [], [10**6]), "token id 1000000"),
        (CachedRequest("b", 1, [1 << 20], [7]), "block id 1048576"),
    ],
)
def test_runner_refuses_ids_past_its_tables(tmp_path, entry, message):
    """A plan's ids index the embedding and the KV cache: one past them must fail the step
    with a message (on CUDA, indexing with it is a device assert that ends the process)."""
    model_dir = make_tiny_model(tmp_path, num_layers=1)
    (runner,) = make_runners(model_dir, num_blocks=128)
    runner.execute(
        StepPlan(0, new_requests=[NewRequest("b", [5, 6], 2, SamplingParams(), [1], 0, 2)])
    )
    plan = StepPlan(1)
    if isinstance(entry, NewRequest):
        plan.new_requests.append(entry)
    else:
        plan.cached_requests.append(entry)
    with pytest.raises(ValueError, match=message):
        runner.execute(plan)


def test_runner_bfloat16_stays_close_to_float32(tmp_path):
    model_dir = make_tiny_model(tmp_path, num_kv_heads=2)
    prompts = make_prompts(4, seed=3)
    logits = {}
    for dtype in ("float32", "bfloat16"):
        runners = make_runners(model_dir, 2, dtype=dtype)
        planner = TinyPlanner(16, 128)
        for i, prompt in enumerate(prompts):
            planner.add(f"r{i}", prompt, 1)
        run_plans(planner, runners)
        logits[dtype] = torch.stack([planner.logits[f"r{i}"][0] for i in range(4)])
    # greedy rows keep the logits as computed (the argmax needs no widening)
    assert logits["bfloat16"].dtype == torch.bfloat16
    torch.testing.assert_close(logits["bfloat16"].float(), logits["float32"], atol=0.1, rtol=0.05)

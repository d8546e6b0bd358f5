"""Pipeline behaviour under churn, chunked prefill, aborts and a tiny KV pool (SmolLM2, P=2)."""

from __future__ import annotations

import random

import grpc
import pytest

from services.common.proto.conveyor.v1 import (
    common_pb2,
    scheduler_pb2,
    worker_pb2,
    worker_pb2_grpc,
)
from tests.integration.conftest import hf_greedy_reference
from tests.integration.utils import ProcessStack, wait_until
from tests.worker.utils import compare_greedy

pytestmark = pytest.mark.slow

TIE_MARGIN = 0.01
CHUNK = 64


@pytest.fixture(scope="module")
def stack(smollm2_dir):
    stack = ProcessStack(
        smollm2_dir,
        2,
        "async",
        scheduler_args=["--max-num-batched-tokens", str(CHUNK)],
    ).start()
    yield stack
    stack.stop()


def assert_greedy_prefix(outcome, ref_tokens, ref_logits):
    n = len(outcome.token_ids)
    compare_greedy(outcome.token_ids, ref_tokens[:n], ref_logits[:n], TIE_MARGIN)


def test_churn_outputs_equal_each_request_alone(stack, smollm2_prompts, smollm2_reference):
    """100 requests, staggered arrivals, random lengths: constant finish/admit churn."""
    ref_tokens, ref_logits = smollm2_reference
    rng = random.Random(7)
    picks = [rng.randrange(len(smollm2_prompts)) for _ in range(100)]
    samplings = [dict(max_tokens=rng.randint(1, 16), ignore_eos=True) for _ in picks]
    delays = [rng.uniform(0.0, 3.0) for _ in picks]
    outcomes = stack.generate_many([smollm2_prompts[i] for i in picks], samplings, delays)
    for pick, sampling, outcome in zip(picks, samplings, outcomes, strict=True):
        assert len(outcome.token_ids) == sampling["max_tokens"]
        assert outcome.finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert_greedy_prefix(outcome, ref_tokens[pick], ref_logits[pick])
    stats = stack.stats()
    assert stats.kv_usage == 0.0 and not stats.request_blocks
    assert stats.prefix_cache_hit_rate > 0, "repeated prompts should hit the prefix cache"


def test_long_prompt_prefilled_in_overlapping_chunks(stack, smollm2_dir, smollm2_prompts):
    # Starts unlike any earlier prompt, so the prefix cache cannot shorten it.
    long_prompt = [100, *(t for p in smollm2_prompts * 3 for t in p)][: 5 * CHUNK - 10]
    ref_tokens, ref_logits = hf_greedy_reference(smollm2_dir, [long_prompt], 8)
    _timelines(stack, reset=True)
    outcome = stack.generate(long_prompt, max_tokens=8, ignore_eos=True)
    assert_greedy_prefix(outcome, ref_tokens[0], ref_logits[0])

    stage0, stage1 = (
        {s.step_id: s for s in t.steps if s.num_tokens == CHUNK} for t in _timelines(stack)
    )
    chunk_steps = sorted(set(stage0) & set(stage1))
    all_steps = [(s.step_id, s.num_tokens) for s in _timelines(stack)[0].steps]
    assert len(chunk_steps) >= 4, f"expected 4 full chunks, got {all_steps}"
    overlaps = [
        s for s in chunk_steps if s + 1 in stage0 and stage0[s + 1].start_ns < stage1[s].end_ns
    ]
    assert overlaps, "no chunk i+1 ran in stage 0 while chunk i ran in stage 1"


def test_workers_describe_their_device_and_work_balanced_split(stack):
    replies = []
    for port in stack.worker_ports:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = worker_pb2_grpc.StageWorkerStub(channel)
            replies.append(stub.Describe(worker_pb2.DescribeRequest(), timeout=10))
    assert [r.device for r in replies] == ["cpu", "cpu"]
    assert [(r.first_layer, r.num_layers) for r in replies] == [(0, 18), (18, 12)]


def test_abort_mid_stream_frees_blocks(stack, smollm2_prompts):
    request = scheduler_pb2.SubmitRequest(
        request_id="abort-me",
        prompt_token_ids=smollm2_prompts[1],
        sampling=common_pb2.SamplingParams(max_tokens=500, ignore_eos=True),
    )
    stream = stack.stub.Submit(request, timeout=120)
    first = next(stream)
    assert first.token_ids
    assert stack.stats().request_blocks["abort-me"] > 0
    assert stack.stub.Abort(scheduler_pb2.AbortRequest(request_id="abort-me")).aborted
    last = list(stream)[-1]
    assert last.finish_reason == common_pb2.FINISH_REASON_ABORT
    wait_until(lambda: stack.stats().kv_usage == 0.0, 10)
    assert not stack.stub.Abort(scheduler_pb2.AbortRequest(request_id="abort-me")).aborted


def test_tiny_kv_pool_preempts_and_every_request_finishes(
    smollm2_dir, smollm2_prompts, smollm2_reference
):
    # 12 blocks of 16 slots for 8 requests of ~10 + 16 tokens (~2 blocks each): preemption.
    stack = ProcessStack(smollm2_dir, 2, "async", kv_cache_memory="4.5MB", max_model_len=128)
    stack.start()
    try:
        assert stack.stats().num_blocks < 16
        prompts = smollm2_prompts[:8]
        outcomes = stack.generate_many(prompts, [dict(max_tokens=16, ignore_eos=True)] * 8)
        stats = stack.stats()
    finally:
        stack.stop()
    assert stats.num_preempted_total > 0, "the pool was meant to force preemptions"
    ref_tokens, ref_logits = smollm2_reference
    for i, outcome in enumerate(outcomes):
        assert len(outcome.token_ids) == 16
        assert_greedy_prefix(outcome, ref_tokens[i], ref_logits[i])


def _timelines(stack, reset: bool = False):
    replies = []
    for port in stack.worker_ports:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = worker_pb2_grpc.StageWorkerStub(channel)
            request = worker_pb2.GetTimelineRequest(include_steps=True, reset=reset)
            replies.append(stub.GetTimeline(request, timeout=10))
    return replies

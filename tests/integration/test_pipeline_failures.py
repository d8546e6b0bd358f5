"""A worker or the scheduler dies mid-run: nothing accepted is lost (SmolLM2, P=2, async)."""

from __future__ import annotations

import concurrent.futures
import threading

import grpc
import pytest

from services.common.proto.conveyor.v1 import common_pb2, scheduler_pb2
from tests.integration.conftest import hf_greedy_reference
from tests.integration.utils import Outcome, ProcessStack, wait_until
from tests.worker.utils import compare_greedy

pytestmark = pytest.mark.slow

NUM_NEW = 40
TIE_MARGIN = 0.01


@pytest.fixture(scope="module")
def reference(smollm2_dir, smollm2_prompts):
    prompts = smollm2_prompts[:4]
    return prompts, hf_greedy_reference(smollm2_dir, prompts, NUM_NEW)


@pytest.fixture(scope="module")
def stack(smollm2_dir):
    stack = ProcessStack(smollm2_dir, 2, "async").start()
    yield stack
    stack.stop()


def _assert_reference(outcomes, reference):
    _, (ref_tokens, ref_logits) = reference
    for i, outcome in enumerate(outcomes):
        assert len(outcome.token_ids) == NUM_NEW
        compare_greedy(outcome.token_ids, ref_tokens[i], ref_logits[i], TIE_MARGIN)


def test_worker_killed_mid_run_every_request_completes(stack, reference):
    prompts, _ = reference
    outcomes: dict[int, Outcome] = {}

    def run(i):
        outcomes[i] = stack.generate(prompts[i], max_tokens=NUM_NEW, ignore_eos=True)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    wait_until(lambda: stack.stats().num_steps > 8, 60)
    stack.kill_worker(1)
    wait_until(lambda: not stack.stats().serving, 30)
    stack.start_worker(1)
    for thread in threads:
        thread.join(timeout=300)
    assert stack.stats().serving
    _assert_reference([outcomes[i] for i in range(len(prompts))], reference)
    assert stack.stats().kv_usage == 0.0


def test_scheduler_killed_resume_delivers_the_rest_without_duplicates(stack, reference):
    prompts, _ = reference
    received: dict[str, list[int]] = {f"resume-{i}": [] for i in range(len(prompts))}
    streams = {}
    for i, request_id in enumerate(received):
        request = scheduler_pb2.SubmitRequest(
            request_id=request_id,
            prompt_token_ids=prompts[i],
            sampling=common_pb2.SamplingParams(max_tokens=NUM_NEW, ignore_eos=True),
        )
        streams[request_id] = stack.stub.Submit(request, timeout=300)
    for request_id, stream in streams.items():  # a few tokens each, then the scheduler dies
        delta = next(stream)
        received[request_id].extend(delta.token_ids)
    stack.kill_scheduler()
    for stream in streams.values():
        with pytest.raises(grpc.RpcError):
            list(stream)
    stack.start_scheduler()

    def resume(request_id: str) -> Outcome:
        """As a router does for each of its broken streams, all at once (a recovered request
        nobody resumes within --orphan-timeout is aborted)."""
        tokens, finish = received[request_id], None
        for delta in stack.stub.Resume(
            scheduler_pb2.ResumeRequest(request_id=request_id, from_offset=len(tokens)),
            timeout=300,
        ):
            assert delta.offset == len(tokens), "Resume skipped or repeated tokens"
            tokens.extend(delta.token_ids)
            finish = delta.finish_reason
        return Outcome(tokens, finish)

    with concurrent.futures.ThreadPoolExecutor(len(received)) as pool:
        outcomes = list(pool.map(resume, received))
    assert all(o.finish_reason == common_pb2.FINISH_REASON_LENGTH for o in outcomes)
    _assert_reference(outcomes, reference)
    wait_until(lambda: stack.stats().kv_usage == 0.0, 10)

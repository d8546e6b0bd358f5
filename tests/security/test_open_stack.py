"""Rows 1 to 3 of issue 13 on a stack without credentials (every client is "anonymous").

Real processes: a stage worker, the scheduler (Redis) and the router. With one principal,
equal ids meet in one namespace, the hardest case for ownership:

1. a second Submit of a running id is ALREADY_EXISTS, and nothing else happens to it;
2. while the pipeline or the scheduler restarts, the second client's router finds nothing of
   the running request when it tries Resume (each Submit's owner token, kept in Redis);
   a cancel that beats its Submit still wins;
3. the prefix cache is shared within a tenant and never across (tenants are self-declared
   without API keys), and usage.cached_tokens says how much of the prompt it served.
"""

from __future__ import annotations

import random
import signal

import grpc
import pytest

from services.client.client import ConveyorClient
from services.common.proto.conveyor.v1 import common_pb2, scheduler_pb2
from tests.integration.utils import wait_until
from tests.scaleout.utils import SERVING, health
from tests.security.utils import RouterStack, stream_in_thread

pytestmark = pytest.mark.slow

LONG = 2000
"""Output tokens of the victim: seconds of decoding, so the second client meets it running."""


@pytest.fixture(scope="module")
def stack(tiny_dir):
    stack = RouterStack(tiny_dir, 1, max_model_len=4096, router_args=("--resume-timeout", "90"))
    yield stack.start()
    stack.stop()


def _victim(stack: RouterStack, request_id: str):
    client = ConveyorClient(stack.address, timeout_s=300)
    victim = stream_in_thread(
        client,
        prompt="the victim's own prompt",
        request_id=request_id,
        max_tokens=LONG,
        ignore_eos=True,
    )
    assert victim.started.wait(120) and victim.error is None, victim.error
    return victim


def _assert_untouched(victim) -> None:
    victim.join()
    assert victim.error is None, victim.error
    assert (victim.finish_reason, len(victim.token_ids)) == ("length", LONG)


def test_duplicate_id_is_already_exists_and_leaves_the_running_request_alone(stack):
    victim = _victim(stack, "shared-1")
    attacker = ConveyorClient(stack.address, timeout_s=60)
    with attacker, pytest.raises(grpc.RpcError) as caught:
        attacker.complete("hello", request_id="shared-1", max_tokens=4)
    assert caught.value.code() is grpc.StatusCode.ALREADY_EXISTS, caught.value.details()
    _assert_untouched(victim)


def test_duplicate_id_during_a_worker_restart_reads_nothing_of_the_running_request(stack):
    victim = _victim(stack, "shared-2")
    pipeline = stack.pipeline
    pipeline.kill_worker(0)
    wait_until(lambda: not pipeline.stats().serving, 60)
    attacker = stream_in_thread(
        ConveyorClient(stack.address, timeout_s=300),
        prompt="hello",
        request_id="shared-2",
        max_tokens=4,
    )
    attacker.started.wait(60)  # its first token (the victim's, before the fix) or its end
    pipeline.start_worker(0)
    attacker.join()
    assert attacker.token_ids == [], "the second client received the running request's tokens"
    assert attacker.error is not None
    assert attacker.error.code() is grpc.StatusCode.UNAVAILABLE, attacker.error.details()
    _assert_untouched(victim)


def test_duplicate_id_during_a_scheduler_restart_reads_nothing_of_the_running_request(stack):
    victim = _victim(stack, "shared-3")
    pipeline = stack.pipeline
    # The scheduler stops answering before it dies, so that the router still takes it for
    # serving when the second Submit arrives and sends it (a router that had seen the
    # scheduler go would refuse the Submit at once: UNAVAILABLE, no pipeline is serving).
    pipeline.scheduler.send_signal(signal.SIGSTOP)
    attacker = stream_in_thread(
        ConveyorClient(stack.address, timeout_s=300),
        prompt="hello",
        request_id="shared-3",
        max_tokens=4,
    )
    wait_until(lambda: health(stack.address, 5.0) != SERVING, 60)
    pipeline.kill_scheduler()
    # The Submit broke with the session, unanswered. The router keeps retrying until the
    # scheduler is back; the restarted scheduler knows the running request (and its owner
    # token) from Redis only, and refuses the Submit as it would have: the id is in use.
    pipeline.start_scheduler()
    # The victim must still run when the second Submit is answered: finished, its id is free
    # again and the Submit rightly runs as a request of its own. The router's session may
    # take seconds to reconnect (its channel's backoff), longer than what the victim has
    # left to decode on a fast machine, so the stage holds still until the answer is in.
    worker = pipeline.workers[0]
    worker.send_signal(signal.SIGSTOP)
    try:
        attacker.join()
    finally:
        worker.send_signal(signal.SIGCONT)
    assert attacker.token_ids == [], "the second client received the running request's tokens"
    assert attacker.error is not None
    assert attacker.error.code() is grpc.StatusCode.ALREADY_EXISTS, attacker.error.details()
    _assert_untouched(victim)
    # The router sees the scheduler back within a second or so (its channel's reconnect
    # backoff is capped, services/common/keepalive.py), so the next test finds it serving.
    stack.router.wait_serving(60)


def test_abort_that_arrives_before_its_submit_wins(stack):
    stub = stack.pipeline.stub
    owner = {"principal": "anonymous", "owner_token": "0123456789abcdef"}
    reply = stub.Abort(scheduler_pb2.AbortRequest(request_id="early", **owner), timeout=30)
    assert not reply.aborted  # nothing to abort yet: remembered instead
    submit = scheduler_pb2.SubmitRequest(
        request_id="early",
        prompt_token_ids=[5, 6, 7],
        sampling=common_pb2.SamplingParams(max_tokens=LONG, ignore_eos=True),
        **owner,
    )
    deltas = list(stub.Submit(submit, timeout=60))
    assert [d.finish_reason for d in deltas] == [common_pb2.FINISH_REASON_ABORT]
    assert sum(len(d.token_ids) for d in deltas) == 0
    # Another submission of the same id (another owner token) is not affected by it.
    other = scheduler_pb2.SubmitRequest(
        request_id="early",
        prompt_token_ids=[5, 6, 7],
        sampling=common_pb2.SamplingParams(max_tokens=3, ignore_eos=True),
        principal="anonymous",
        owner_token="another-submission",
    )
    deltas = list(stub.Submit(other, timeout=60))
    assert deltas[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert sum(len(d.token_ids) for d in deltas) == 3


def test_prefix_cache_is_shared_within_a_tenant_and_never_across(stack):
    # 80 prompt tokens = 5 blocks of 16; the cache serves whole blocks but always leaves the
    # last prompt token to compute, so a repeat of this prompt finds 4 blocks = 64 tokens.
    rng = random.Random(13)
    prompt = [rng.randrange(20, 300) for _ in range(80)]
    with ConveyorClient(stack.address, timeout_s=120) as client:

        def cached(tenant: str) -> int:
            result = client.complete(token_ids=prompt, tenant=tenant, max_tokens=1)
            return result.usage["cached_tokens"]

        assert cached("team-a") == 0
        assert cached("team-b") == 0, "team-b was served team-a's blocks"
        assert cached("team-a") == 64
        assert cached("team-b") == 64

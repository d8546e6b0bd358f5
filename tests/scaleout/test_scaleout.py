"""Two pipelines behind the routers (docs/scale-out.md), real processes end to end: greedy
output as one pipeline's (HF's), prefix routing's cache hits against round-robin's, and a
pipeline lost for good under 32 streams whose requests another pipeline adopts.

The test that kills a pipeline runs last: the stack is shared (tests/scaleout/conftest.py).
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from pathlib import Path

from services.common.proto.conveyor.v1 import common_pb2
from tests.faults.utils import wait_until
from tests.scaleout.conftest import MAX_TOKENS
from tests.scaleout.utils import SERVING, health, run_streams
from tests.worker.utils import compare_greedy

TIE_MARGIN = 1e-4  # a flip to HF's 2nd choice is accepted only below this top-2 margin
STOP = common_pb2.FINISH_REASON_STOP
LENGTH = common_pb2.FINISH_REASON_LENGTH


def check_greedy(outcomes, prompts_index, reference) -> None:
    ref_tokens, ref_logits = reference
    for outcome, i in zip(outcomes, prompts_index, strict=True):
        assert outcome.error is None, outcome
        assert outcome.finish_reason == LENGTH and outcome.offsets_ok, outcome
        assert len(outcome.token_ids) == MAX_TOKENS
        compare_greedy(outcome.token_ids, ref_tokens[i], ref_logits[i], TIE_MARGIN)


def test_two_pipelines_greedy_equals_one(stack, prompts, reference):
    """Round-robin spreads the prompts over both pipelines; every output is HF's greedy
    one, as a single pipeline's is."""
    for pipeline in stack.pipelines:  # the router's view of a pipeline lags its health
        wait_routed_to(stack, "round-robin", pipeline, prompts[0])
    before = [p.stats().num_prefix_queried_tokens for p in stack.pipelines]
    outcomes = run_streams(stack.routers["round-robin"], prompts, MAX_TOKENS)
    check_greedy(outcomes, range(len(prompts)), reference)
    after = [p.stats().num_prefix_queried_tokens for p in stack.pipelines]
    assert all(a > b for a, b in zip(after, before, strict=True)), "a pipeline got nothing"


def prefix_workload(seed: int, num_prefixes: int = 7, rounds: int = 3) -> list[list[int]]:
    """`rounds` passes over `num_prefixes` prompts of a 128-token shared prefix (8 blocks)
    and an 8-token unique suffix. 7 prefixes x 8 blocks = 56 blocks: more than one
    pipeline's 45, fewer than both's 90. Odd, so that round-robin shows every prefix to
    both pipelines."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1000, 40000) for _ in range(128)] for _ in range(num_prefixes)]
    return [
        prefix + [rng.randrange(1000, 40000) for _ in range(8)]
        for _ in range(rounds)
        for prefix in prefixes
    ]


def hit_rate(stack, router: str, prompts: list[list[int]]) -> float:
    """Prefix-cache hit rate (hit / queried prompt tokens, both pipelines) of `prompts`
    sent one after the other through `router`."""
    hit0, queried0 = stack.prefix_counters()
    for prompt in prompts:
        (outcome,) = run_streams(router, [prompt], 2)
        assert outcome.error is None and outcome.finish_reason == LENGTH, outcome
    hit1, queried1 = stack.prefix_counters()
    return (hit1 - hit0) / (queried1 - queried0)


def test_prefix_routing_hits_the_cache_more_than_round_robin(stack):
    """Counters, not timings: the same workload shape (fresh prefixes for each router)
    hits the prefix caches at least 1.5x as often when routed by prefix."""
    round_robin = hit_rate(stack, stack.routers["round-robin"], prefix_workload(1))
    prefix = hit_rate(stack, stack.routers["prefix"], prefix_workload(2))
    print(f"prefix-cache hit rate: round-robin {round_robin:.3f}, prefix {prefix:.3f}")
    assert prefix >= 1.5 * round_robin
    assert prefix > 0.5  # every prefix after its first pass, on the pipeline that holds it


def test_stalled_pipeline_judged_lost_streams_no_token_the_adopter_lacks(stack, prompts, reference):
    """p1's scheduler stalls (SIGSTOP) past its announcement's TTL while its worker steps
    on: p0 adopts its requests. Back, p1 writes the step it missed; the store refuses it
    (another pipeline owns them) and p1 streams none of those tokens, lets the requests go,
    and the router resumes them at p0: every stream ends with HF's tokens, no gap and no
    duplicate. Then p1 serves again."""
    stalled = stack.pipelines[1]
    client = stack.redis.client()
    held = {}

    def stall():
        stats = stalled.stats()
        held["requests"] = stats.num_running + stats.num_waiting
        scheduler = stalled.procs["scheduler"]
        os.kill(scheduler.pid, signal.SIGSTOP)
        try:
            wait_until(lambda: client.zcard("conveyor:unfinished:p1") == 0, 60, 0.1)
        finally:
            os.kill(scheduler.pid, signal.SIGCONT)

    # Round-robin: half the streams are p1's whatever the caches hold (run alone, on a fresh
    # stack, prefix routing may send a whole burst to one pipeline).
    outcomes = run_streams(stack.routers["round-robin"], prompts, MAX_TOKENS, stall, 24)
    assert held["requests"] > 0, "p1 held no request: nothing was adopted"
    check_greedy(outcomes, range(len(prompts)), reference)
    wait_until(lambda: health(stalled.scheduler) == SERVING, 60, 0.5)
    wait_until(lambda: len(client.smembers("conveyor:pipelines")) == 2, 30)
    stats = stalled.stats()
    assert stats.num_running + stats.num_waiting == 0
    wait_routed_to(stack, "prefix", stalled, prompts[0])


def test_streams_of_a_stopped_pipeline_go_on_at_the_adopter(stack, prompts, reference):
    """p1's scheduler stops (SIGSTOP) mid-run and stays stopped. A stopped process never
    breaks its streams: the router's waited on it (while p0 adopted the requests and, nobody
    resuming them there, aborted them as orphans). The router breaks the streams of a
    pipeline whose announcement expired and resumes them at p0, and a Submit still unread in
    p1's socket (no scheduler persisted it) is submitted again at p0: every stream ends with
    HF's tokens while p1 is still stopped (such Submits failed UNAVAILABLE, "no scheduler
    took request": retry it, before)."""
    stalled = stack.pipelines[1]
    scheduler = stalled.procs["scheduler"]
    done = {}

    def stream_all() -> None:
        done["outcomes"] = run_streams(stack.routers["round-robin"], prompts, MAX_TOKENS)

    streams = threading.Thread(target=stream_all, daemon=True)
    streams.start()
    wait_until(lambda: stalled.stats().num_running > 0, 60, 0.02)
    os.kill(scheduler.pid, signal.SIGSTOP)
    try:
        streams.join(120)
        assert not streams.is_alive(), "the streams of the stopped pipeline waited on it"
    finally:
        os.kill(scheduler.pid, signal.SIGCONT)
    try:
        check_greedy(done["outcomes"], range(len(prompts)), reference)
    finally:
        wait_until(lambda: health(stalled.scheduler) == SERVING, 60, 0.5)
        client = stack.redis.client()
        wait_until(lambda: len(client.smembers("conveyor:pipelines")) == 2, 30)
        # p0 adopted every request and its cache holds every prompt: prefix routing would
        # send the next tests' streams all there.
        wait_routed_to(stack, "prefix", stalled, prompts[0])


def test_a_stopped_scheduler_that_wakes_never_runs_a_submit_sent_again_elsewhere(
    stack, prompts, reference
):
    """p1's scheduler stops (SIGSTOP) idle; the round-robin router, which takes it for
    SERVING for a few more health checks, sends it one of two Submits. Nobody reads it: the
    router finds p1 lost and submits it again at p0, where both finish. When p1 wakes, the
    stale Submit must not run there a second time, unstreamed (it did: the router's session
    to the lost scheduler stayed open, holding the unread Submit)."""
    stalled = stack.pipelines[1]
    scheduler = stalled.procs["scheduler"]
    # the round-robin router takes p1 for SERVING again since the last test stopped it
    wait_routed_to(stack, "round-robin", stalled, prompts[0])
    queried = stalled.stats().num_prefix_queried_tokens
    log = Path(stack.log.name)
    resubmits = log.read_text().count("no scheduler took request")
    os.kill(scheduler.pid, signal.SIGSTOP)
    try:
        outcomes = run_streams(stack.routers["round-robin"], prompts[:2], MAX_TOKENS)
    finally:
        os.kill(scheduler.pid, signal.SIGCONT)
    check_greedy(outcomes, range(2), reference)
    assert log.read_text().count("no scheduler took request") > resubmits, "p1 got no Submit"
    wait_until(lambda: health(stalled.scheduler) == SERVING, 60, 0.5)
    time.sleep(3)  # what p1 reads on waking, it reads at once
    stats = stalled.stats()
    assert stats.num_prefix_queried_tokens == queried, "p1 admitted the stale Submit"
    assert stats.num_running + stats.num_waiting == 0
    client = stack.redis.client()
    wait_until(lambda: len(client.smembers("conveyor:pipelines")) == 2, 30)
    wait_routed_to(stack, "prefix", stalled, prompts[0])


def test_not_serving_pipeline_requests_are_adopted_with_exact_tokens(stack, prompts, reference):
    """p1's worker dies mid-run; its scheduler lives on, NOT_SERVING. Past the grace period
    p0 adopts its requests, p1 lets them go (their streams end naming p0) and the router
    resumes them there. Then p1's worker comes back and p1 serves again, empty."""
    lost = stack.pipelines[1]
    held = {}

    def kill_worker():
        stats = lost.stats()
        held["requests"] = stats.num_running + stats.num_waiting
        lost.kill("worker")

    outcomes = run_streams(stack.routers["prefix"], prompts, MAX_TOKENS, kill_worker, 24)
    assert held["requests"] > 0, "p1 held no request: nothing was adopted"
    check_greedy(outcomes, range(len(prompts)), reference)
    client = stack.redis.client()
    assert client.zcard("conveyor:unfinished:p1") == 0
    stack.restart(lost, "worker")
    wait_until(lambda: health(lost.scheduler) == SERVING, 180, 0.5)
    stats = lost.stats()
    assert stats.num_running + stats.num_waiting == 0
    wait_routed_to(stack, "prefix", lost, prompts[0])


def wait_routed_to(stack, routing: str, pipeline, prompt: list[int]) -> None:
    """Until the router sends requests to `pipeline` again (it polls health each second)."""
    before = pipeline.stats().num_prefix_queried_tokens

    def routed() -> bool:
        (outcome,) = run_streams(stack.routers[routing], [prompt], 1)
        assert outcome.error is None, outcome
        return pipeline.stats().num_prefix_queried_tokens > before

    wait_until(routed, 60, 0.2)


def test_lost_pipeline_requests_are_adopted_with_exact_tokens(stack, prompts, reference):
    """32 streams through the prefix router; one pipeline is killed for good mid-run. Its
    announcement expires, the other pipeline adopts its requests from Redis and recomputes
    them, and the router resumes each stream there: every stream ends with HF's tokens, no
    gap and no duplicate."""
    lost, survivor = stack.pipelines[1], stack.pipelines[0]
    index = list(range(len(prompts))) * 2
    held = {}

    def kill():
        stats = lost.stats()
        held["requests"] = stats.num_running + stats.num_waiting
        lost.kill()

    outcomes = run_streams(
        stack.routers["prefix"], [prompts[i] for i in index], MAX_TOKENS, kill, after_tokens=48
    )
    assert held["requests"] > 0, "the killed pipeline held no request: nothing was adopted"
    check_greedy(outcomes, index, reference)
    client = stack.redis.client()
    wait_until(lambda: client.smembers("conveyor:pipelines") == {b"p0"}, 30)
    assert client.zcard("conveyor:unfinished:p1") == 0
    assert survivor.stats().serving

"""Faults under load: 32 streams through the router of a `conveyor up` stack (tiny model, 2
stages, async) while a worker, the scheduler, the router or Redis dies or stalls.

Every accepted request either completes exactly once with the tokens of an undisturbed run
(no gap, no duplicate), or ends with a clear status; health tells the truth; afterwards
every KV block is free and no Redis key outlives its TTL. One stack serves every test (in
file order); `conveyor up` restarts what was killed.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import grpc
import pytest

from services.common.proto.conveyor.v1 import common_pb2
from services.scheduler.store import meta_key, tokens_key
from tests.faults.utils import SERVING, RedisProcess, UpStack, redis_leftovers, wait_until

pytestmark = pytest.mark.slow

NUM_STREAMS = 32
MAX_TOKENS = 48
STOP = common_pb2.FINISH_REASON_LENGTH


def _prompts(seed: int) -> list[list[int]]:
    """Distinct prompts of mixed lengths (ids of the tiny model's vocabulary)."""
    return [
        [(seed * 131 + i * 17 + j * 7) % 300 + 1 for j in range(5 + (i * 7) % 40)]
        for i in range(NUM_STREAMS)
    ]


def undisturbed(stack: UpStack):
    """prompt seed -> the undisturbed outputs of its prompts on `stack` (once per seed)."""
    cache: dict[int, list[list[int]]] = {}

    def get(seed: int) -> list[list[int]]:
        if seed not in cache:
            outcomes = stack.run_streams(_prompts(seed), MAX_TOKENS)
            assert all(o.error is None and o.finish_reason == STOP for o in outcomes)
            cache[seed] = [o.token_ids for o in outcomes]
        return cache[seed]

    return get


@pytest.fixture(scope="module")
def reference(stack):
    return undisturbed(stack)


def _check_after(stack: UpStack, redis_proc: RedisProcess) -> None:
    stack.wait_serving()
    stats = stack.wait_idle()
    assert stats.serving and stats.num_free_blocks == stats.num_blocks
    # Within a store check (1 s) the scheduler has closed what a stale Redis still listed.
    try:
        wait_until(lambda: not redis_leftovers(redis_proc.client()), 15)
    except AssertionError:
        assert redis_leftovers(redis_proc.client()) == []


def _assert_exact(outcomes, expected) -> None:
    for i, (outcome, tokens) in enumerate(zip(outcomes, expected, strict=True)):
        assert outcome.error is None, f"stream {i} ended with {outcome.error}"
        assert outcome.offsets_ok, f"stream {i} received a gap or a duplicate"
        assert outcome.token_ids == tokens, f"stream {i} differs from the undisturbed run"
        assert outcome.finish_reason == STOP


def _assert_stored(redis_proc: RedisProcess, outcomes) -> None:
    """The store holds every stream's request as finished, with the tokens its client got."""
    client = redis_proc.client()
    for i, outcome in enumerate(outcomes):
        name = f"anonymous/{outcome.request_id}"  # the scheduler's name: principal/id
        stored = [int(t) for t in client.lrange(tokens_key(name), 0, -1)]
        assert stored == outcome.token_ids, (
            f"stream {i}: the store holds {len(stored)} tokens, its client got "
            f"{len(outcome.token_ids)} (or different ones)"
        )
        assert client.hget(meta_key(name), "state") == b"finished_length", f"stream {i}"


@pytest.mark.parametrize("kind", ["worker 1", "worker 0", "scheduler"])
def test_a_killed_worker_or_scheduler_loses_nothing(stack, redis_proc, reference, kind):
    seed = {"worker 1": 1, "worker 0": 2, "scheduler": 3}[kind]
    expected = reference(seed)
    killed = []
    outcomes = stack.run_streams(
        _prompts(seed),
        MAX_TOKENS,
        fault=lambda: killed.append(stack.kill(kind)),
        after_tokens=NUM_STREAMS * MAX_TOKENS // 4,
    )
    assert killed
    _assert_exact(outcomes, expected)
    _check_after(stack, redis_proc)
    assert stack.child_pid(kind) != killed[0], "conveyor up did not restart it"


def test_a_killed_router_ends_its_streams_clearly_and_its_requests_are_aborted(
    stack, redis_proc, reference
):
    long = 1900  # far more than can be generated before the scheduler gives up on them
    outcomes = stack.run_streams(
        _prompts(4), long, fault=lambda: stack.kill("router"), after_tokens=NUM_STREAMS * 4
    )
    assert all(o.error is grpc.StatusCode.UNAVAILABLE and o.offsets_ok for o in outcomes)
    # The scheduler aborts what nobody listens to any more (--orphan-timeout): KV all free.
    _check_after(stack, redis_proc)
    client = redis_proc.client()
    # the scheduler names a request by its principal (anonymous here) and id
    states = {client.hget(f"{{req:anonymous/{o.request_id}}}:meta", "state") for o in outcomes}
    assert states == {b"finished_aborted"}, "requests of a dead router ran on"
    _assert_exact(stack.run_streams(_prompts(4), MAX_TOKENS), reference(4))  # a new router


def test_redis_killed_and_restarted_empty_is_rewritten_from_memory(stack, redis_proc, reference):
    expected = reference(5)

    def restart_empty() -> None:
        redis_proc.kill()
        redis_proc.start(fresh=True)

    outcomes = stack.run_streams(
        _prompts(5), MAX_TOKENS, fault=restart_empty, after_tokens=NUM_STREAMS * MAX_TOKENS // 4
    )
    _assert_exact(outcomes, expected)
    # The scheduler noticed the new Redis and wrote every live request again: the empty
    # store ends up holding each stream whole (not only the tokens after the restart).
    _assert_stored(redis_proc, outcomes)
    _check_after(stack, redis_proc)


def test_redis_restarted_from_a_stale_snapshot_neither_wedges_nor_repeats(
    stack, redis_proc, reference
):
    expected = reference(6)

    def restart_stale() -> None:
        redis_proc.save()  # the snapshot the restart loads: some tokens behind
        time.sleep(1.0)
        redis_proc.kill()
        redis_proc.start()

    outcomes = stack.run_streams(
        _prompts(6), MAX_TOKENS, fault=restart_stale, after_tokens=NUM_STREAMS * MAX_TOKENS // 8
    )
    _assert_exact(outcomes, expected)
    _check_after(stack, redis_proc)


def test_redis_paused_streams_complete_and_health_says_not_serving(stack, redis_proc, reference):
    expected = reference(7)
    statuses: list[int | None] = []
    pausing = threading.Event()

    def watch() -> None:
        while pausing.is_set():
            statuses.append(stack.health(stack.scheduler, timeout_s=3.0))
            time.sleep(0.1)

    def pause() -> None:
        pausing.set()
        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        redis_proc.pause()
        try:  # 5 s at least, and until health said so (a starved host may see it late)
            time.sleep(5.0)
            wait_until(lambda: any(s is not None and s != SERVING for s in statuses), 60)
        finally:
            redis_proc.cont()
        stack.wait_serving()
        pausing.clear()
        watcher.join()

    outcomes = stack.run_streams(
        _prompts(7), MAX_TOKENS, fault=pause, after_tokens=NUM_STREAMS * MAX_TOKENS // 4
    )
    _assert_exact(outcomes, expected)
    assert any(s is not None and s != SERVING for s in statuses), (
        f"health never said NOT_SERVING while Redis was paused past --store-grace: {statuses}"
    )
    _check_after(stack, redis_proc)


def test_a_stopped_worker_is_found_hung_and_nothing_is_lost(stack, redis_proc, reference):
    """A stage that stops answering without dying (SIGSTOP: as a wedged kernel or collective
    would): past --step-timeout (10 s here) the scheduler says NOT_SERVING, naming the hung
    stage, rather than wait forever SERVING; once it runs again every stream completes
    exactly."""
    expected = reference(8)
    reasons: list[str] = []

    def stop_worker() -> None:
        pid = stack.kill("worker 1", signal.SIGSTOP)
        try:
            # first the timeout, then which stage does not answer
            wait_until(lambda: _not_serving_reason(stack, reasons), 120, interval_s=0.5)
            wait_until(lambda: "unreachable" in _reason(stack, reasons), 60, interval_s=0.5)
        finally:
            os.kill(pid, signal.SIGCONT)

    outcomes = stack.run_streams(
        _prompts(8), MAX_TOKENS, fault=stop_worker, after_tokens=NUM_STREAMS * MAX_TOKENS // 4
    )
    _assert_exact(outcomes, expected)
    assert "--step-timeout" in reasons[0], reasons
    assert "--step-timeout" in reasons[-1] and "unreachable" in reasons[-1], reasons
    _check_after(stack, redis_proc)


def _not_serving_reason(stack: UpStack, reasons: list[str]) -> bool:
    try:
        stats = stack.stats()
    except grpc.RpcError:
        return False
    if not stats.serving:
        reasons.append(stats.not_serving_reason)
    return not stats.serving


def _reason(stack: UpStack, reasons: list[str]) -> str:
    _not_serving_reason(stack, reasons)
    return reasons[-1] if reasons else ""


def test_a_stopped_scheduler_does_not_take_itself_for_a_hung_stage(stack, redis_proc, reference):
    """The scheduler paused past --step-timeout (a paused VM): back, its stages' reports
    wait unread in the sockets, and it must read them rather than call a stage hung and
    re-form the pipeline (which recomputed every request and threw the prefix cache away)."""
    expected = reference(9)
    log = Path(stack.log.name)
    before = log.read_text().count("a stage is hung")

    def stop_scheduler() -> None:
        pid = stack.kill("scheduler", signal.SIGSTOP)
        time.sleep(12)  # past the stack's --step-timeout=10
        os.kill(pid, signal.SIGCONT)

    outcomes = stack.run_streams(
        _prompts(9), MAX_TOKENS, fault=stop_scheduler, after_tokens=NUM_STREAMS * MAX_TOKENS // 4
    )
    _assert_exact(outcomes, expected)
    _check_after(stack, redis_proc)
    assert log.read_text().count("a stage is hung") == before

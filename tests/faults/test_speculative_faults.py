"""Faults with speculation on: 32 streams through a `conveyor up` stack (tiny model, 2
stages, async) whose scheduler asks a draft worker (the target as its own draft, so nearly
every proposal is accepted and most steps carry proposals) while the draft worker, a stage
worker, the scheduler or Redis dies. Many streams at once are the load under which the
scheduler applies several reports per Redis flush and joins queued plans into one message.

As without speculation (test_faults.py): every stream gets exactly the tokens of an
undisturbed run or a clear status, KV and Redis end empty; a dead draft worker only stops
speculation (health stays SERVING), and its restart brings the proposals back.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.models.tiny import make_tiny_model
from tests.faults.test_faults import (
    MAX_TOKENS,
    NUM_STREAMS,
    _assert_exact,
    _assert_stored,
    _check_after,
    undisturbed,
)
from tests.faults.test_faults import _prompts as prompts
from tests.faults.utils import SERVING, RedisProcess, UpStack, serving_stack, wait_until

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def spec_redis(tmp_path_factory):
    """A Redis of its own: the session's stack (test_faults.py) runs over the other one."""
    proc = RedisProcess(tmp_path_factory.mktemp("spec-redis")).start(fresh=True)
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def spec_stack(tmp_path_factory, spec_redis):
    model = make_tiny_model(tmp_path_factory.mktemp("tiny") / "m", tie_word_embeddings=False)
    spec = json.dumps({"model": str(model), "num_speculative_tokens": 4})
    up_args = ("--speculative-config", spec)
    with serving_stack(tmp_path_factory, spec_redis, model, up_args) as stack:
        # Until the draft worker has answered once: a cold first call can miss the 1 s
        # deadline, and the client then rests 5 s, longer than a reference run (seen in CI).
        wait_until(lambda: _draft_answered(stack), 120, interval_s=1.0)
        yield stack


def _changes_since_save(redis_proc: RedisProcess) -> int:
    return redis_proc.client().info("persistence")["rdb_changes_since_last_save"]


def _draft_answered(stack: UpStack) -> bool:
    stack.run_streams(prompts(0)[:4], 8)
    return stack.stats().num_draft_calls > 0


def _accepted_since(stack: UpStack, earlier) -> bool:
    """A few short streams, then whether proposals were accepted since `earlier` stats."""
    stack.run_streams(prompts(0)[:4], 8)
    return stack.stats().num_spec_accepted_tokens > earlier.num_spec_accepted_tokens


@pytest.fixture(scope="module")
def reference(spec_stack):
    """prompt seed -> the undisturbed outputs (with speculation) of its prompts."""
    return undisturbed(spec_stack)


def _draft_pid(stack: UpStack) -> int | None:
    """The live draft worker's pid; None between its death and its restart."""
    try:
        return stack.child_pid("worker draft")
    except LookupError:
        return None


def _draft_address(stack: UpStack) -> str:
    """HOST:PORT of the live draft worker (from its command line)."""
    args = Path(f"/proc/{stack.child_pid('worker draft')}/cmdline").read_bytes().split(b"\0")
    args = [a.decode() for a in args]
    return f"{args[args.index('--host') + 1]}:{args[args.index('--port') + 1]}"


def test_a_killed_draft_worker_stops_only_speculation(spec_stack, spec_redis, reference):
    expected = reference(11)
    before = spec_stack.stats()
    assert before.num_draft_calls > 0 and before.num_spec_accepted_tokens > 0
    killed, health = [], []

    def kill_draft() -> None:
        killed.append(spec_stack.kill("worker draft"))
        health.append(spec_stack.health(spec_stack.scheduler, timeout_s=3.0))

    outcomes = spec_stack.run_streams(
        prompts(11), MAX_TOKENS, fault=kill_draft, after_tokens=NUM_STREAMS * MAX_TOKENS // 4
    )
    _assert_exact(outcomes, expected)
    health.append(spec_stack.health(spec_stack.scheduler, timeout_s=3.0))
    assert health == [SERVING, SERVING], "a dead draft worker made the scheduler unhealthy"
    after = spec_stack.stats()
    assert after.num_draft_failures > before.num_draft_failures and after.draft_problem
    _check_after(spec_stack, spec_redis)

    # conveyor up restarts it; once it serves, the scheduler's rest after the failure is
    # over and the new worker answered within its deadline (a cold first call may miss it
    # and rest the client again), streams get proposals again
    wait_until(lambda: _draft_pid(spec_stack) not in (None, killed[0]), 60)
    wait_until(lambda: spec_stack.health(_draft_address(spec_stack)) == SERVING, 120)
    wait_until(lambda: _accepted_since(spec_stack, after), 120, interval_s=1.0)
    back = spec_stack.stats()
    _assert_exact(spec_stack.run_streams(prompts(11), MAX_TOKENS), expected)
    again = spec_stack.stats()
    assert again.num_draft_calls > back.num_draft_calls and not again.draft_problem
    assert again.num_spec_accepted_tokens > back.num_spec_accepted_tokens


@pytest.mark.parametrize("kind", ["worker 1", "scheduler"])
def test_a_killed_worker_or_scheduler_loses_nothing_with_speculation(
    spec_stack, spec_redis, reference, kind
):
    seed = {"worker 1": 12, "scheduler": 13}[kind]
    expected = reference(seed)
    killed = []
    outcomes = spec_stack.run_streams(
        prompts(seed),
        MAX_TOKENS,
        fault=lambda: killed.append(spec_stack.kill(kind)),
        after_tokens=NUM_STREAMS * MAX_TOKENS // 4,
    )
    assert killed
    _assert_exact(outcomes, expected)
    _check_after(spec_stack, spec_redis)
    # Speculation goes on. A restarted scheduler's first draft call can miss its 1 s deadline
    # on a busy host, and its client then rests while the rest of the run decodes without
    # proposals (seen once: 0 accepted): what counts is that proposals come back.
    after = spec_stack.stats()
    wait_until(lambda: _accepted_since(spec_stack, after), 120, interval_s=1.0)


@pytest.mark.parametrize("snapshot", ["empty", "stale"])
def test_redis_restarted_loses_nothing_with_speculation(
    spec_stack, spec_redis, reference, snapshot
):
    seed = {"empty": 14, "stale": 15}[snapshot]
    expected = reference(seed)

    def restart() -> None:
        if snapshot == "stale":
            spec_redis.save()  # the snapshot the restart loads: some flushes behind
            # Not a fixed sleep: speculating streams may all end within a second, and a
            # restart after that tests nothing (the scheduler then closes the stale entries
            # at once, so the wait below never sees them).
            wait_until(lambda: _changes_since_save(spec_redis) >= 3, 30, interval_s=0.01)
        spec_redis.kill()
        spec_redis.start(fresh=snapshot == "empty")

    outcomes = spec_stack.run_streams(
        prompts(seed), MAX_TOKENS, fault=restart, after_tokens=NUM_STREAMS * MAX_TOKENS // 8
    )
    _assert_exact(outcomes, expected)
    if snapshot == "empty":  # rewritten whole (a stale snapshot's closed leftovers are not)
        _assert_stored(spec_redis, outcomes)
    _check_after(spec_stack, spec_redis)

"""Request state in a real Redis: recovery, idempotent appends, round trips, outages."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import threading
import time

import pytest
import redis

from services.common.errors import RequestExists, StateStoreError, StoreLost
from services.common.step import StepResult
from services.scheduler.request import RequestStatus
from services.scheduler.scheduler import Scheduler
from services.scheduler.state import RequestUpdate
from services.scheduler.store import RedisStateStore, meta_key
from tests.conftest import free_port
from tests.scheduler.utils import (
    FakeWorkers,
    Trace,
    collect,
    drive,
    expected_output,
    make_config,
    make_request,
)


@pytest.fixture
def store(redis_url):
    redis.Redis.from_url(redis_url).flushdb()
    store = RedisStateStore(redis_url)
    yield store
    store.close()


def _requests():
    return [
        make_request(f"r{i}", 6 + 3 * i, 10 + i, tenant=f"t{i % 2}", priority=i % 2)
        for i in range(8)
    ]


def test_store_recover_after_restart_gives_the_same_token_logs(store, redis_url):
    config = make_config(num_stages=2, scheduling="async", max_num_seqs=4, num_blocks=40)
    expected = {r.request_id: expected_output(r, config.max_model_len) for r in _requests()}

    uninterrupted = Scheduler(config)
    for request in _requests():
        uninterrupted.add_request(request)
    reference = drive(uninterrupted, FakeWorkers(True, config.block_size), result_delay=3)
    assert reference.outputs == expected

    first = Scheduler(config, store)
    for request in _requests():
        first.add_request(request)
    trace = drive(first, FakeWorkers(True, config.block_size), result_delay=3, max_steps=12)
    assert first.has_unfinished and any(trace.outputs.values()), "restart mid-generation"
    del first  # crash: in-flight results and worker state are lost

    recovered = Scheduler.recover(config, RedisStateStore(redis_url))
    assert {r for r in recovered.requests} == {r for r in expected if r not in trace.finish_reasons}
    resumed = [r for r in recovered.requests.values() if r.output_token_ids]
    assert resumed and all(r.status is RequestStatus.WAITING for r in resumed)
    drive(recovered, FakeWorkers(True, config.block_size), result_delay=3, trace=trace)

    assert trace.outputs == reference.outputs
    for request_id, tokens in reference.outputs.items():
        assert store.read_tokens(request_id) == tokens
        assert store.read_state(request_id).is_finished
    assert Scheduler.recover(config, store).requests == {}


def test_store_replayed_step_appends_nothing_twice(store):
    scheduler = Scheduler(make_config(), store)
    scheduler.add_request(make_request("r", 4, 10, ignore_eos=True))
    plan = scheduler.schedule()
    result = StepResult(plan.step_id, ["r"], [11])
    scheduler.process_result(result)
    assert scheduler.process_result(result) == []  # the same step again
    update = RequestUpdate("r", RequestStatus.RUNNING, offset=0, token_ids=[11, 12])
    store.apply([update])
    store.apply([update])  # a re-sent flush
    assert store.read_tokens("r") == [11, 12]
    assert store.read_tokens("r", offset=1) == [12]
    assert store.read_prompt_len("r") == 4  # a resume's usage.prompt_tokens
    assert store.read_prompt_len("unknown") == 0
    with pytest.raises(StoreLost, match="lost the state of 1 requests"):  # a gap: rewrite
        store.apply([RequestUpdate("r", offset=5, token_ids=[99])])
    assert store.read_tokens("r") == [11, 12]


def test_store_one_round_trip_per_step(store):
    config = make_config(num_stages=2, max_num_seqs=4)
    scheduler = Scheduler(config, store)
    for request in _requests():
        scheduler.add_request(request)
    workers, trace, per_step = FakeWorkers(True, config.block_size), Trace(), []
    while scheduler.has_unfinished:
        before = store.round_trips
        plan = scheduler.schedule()
        assert store.round_trips == before  # planning never waits on Redis
        collect(trace, scheduler.process_result(workers.run(plan)))
        per_step.append((plan.num_requests > 0, store.round_trips - before))
    # Every step that ran something costs exactly one round trip; an idle one costs none.
    assert set(per_step) <= {(True, 1), (False, 0)} and (True, 1) in per_step
    assert len(trace.outputs) == 8


def test_store_steps_applied_together_persist_in_one_round_trip(store):
    """A service that fell behind applies every report waiting, then flushes once: one
    round trip for several steps, and every token still streamed once, in order."""
    config = make_config(num_stages=2, scheduling="async", max_num_seqs=4)
    scheduler = Scheduler(config, store)
    for request in _requests():
        scheduler.add_request(request)
    workers, trace, batch_sizes = FakeWorkers(True, config.block_size), Trace(), []
    for _ in range(1000):
        if not scheduler.has_unfinished:
            break
        plans = [scheduler.schedule() for _ in range(config.steps_in_flight)]
        results = [workers.run(p) for p in plans if p.num_requests or p.finished_request_ids]
        before = store.round_trips
        for result in results:
            scheduler.apply_result(result)
        collect(trace, scheduler.outputs.flush())
        assert store.round_trips - before <= 1
        batch_sizes.append(sum(bool(r.request_ids) for r in results))
    assert not scheduler.has_unfinished and max(batch_sizes) >= 3
    expected = {r.request_id: expected_output(r, config.max_model_len) for r in _requests()}
    assert trace.outputs == expected
    assert {r: store.read_tokens(r) for r in expected} == expected


def test_store_finished_requests_expire(store, redis_url):
    store.finished_ttl_s = 120
    scheduler = Scheduler(make_config(), store)
    scheduler.add_request(make_request("r", 4, 1))
    plan = scheduler.schedule()
    scheduler.process_result(StepResult(plan.step_id, ["r"], [3]))
    client = redis.Redis.from_url(redis_url)
    assert 0 < client.ttl("{req:r}:tokens") <= 120 and 0 < client.ttl("{req:r}:meta") <= 120
    assert client.zcard("conveyor:unfinished") == 0


def test_store_redis_unreachable_raises_and_queues_nothing():
    store = RedisStateStore(f"redis://127.0.0.1:{free_port()}/0", timeout_s=0.5)
    scheduler = Scheduler(make_config(), store)
    with pytest.raises(StateStoreError, match="did not answer.*--redis-url"):
        scheduler.add_request(make_request("r"))
    assert scheduler.num_waiting == 0 and not scheduler.has_unfinished


@pytest.fixture
def own_redis(tmp_path):
    """A redis-server this test may freeze (SIGSTOP) and thaw."""
    port = free_port()
    proc = subprocess.Popen(
        [
            shutil.which("redis-server"),
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(tmp_path),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    for _ in range(200):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            break
        except OSError:
            time.sleep(0.05)
    yield proc, f"redis://127.0.0.1:{port}/0"
    os.kill(proc.pid, signal.SIGCONT)
    proc.terminate()
    proc.wait(timeout=10)


def test_store_outage_mid_run_loses_and_duplicates_nothing(own_redis):
    proc, url = own_redis
    config = make_config(num_stages=1, max_num_seqs=4)
    # the paused write times out whatever the timeout; a short one would fail a write after
    # SIGCONT too on a starved host
    store = RedisStateStore(url, timeout_s=2.0)
    scheduler = Scheduler(config, store)
    requests = _requests()[:4]
    for request in requests:
        scheduler.add_request(request)
    workers, trace, failures = FakeWorkers(True, config.block_size), Trace(), 0
    step = 0
    while scheduler.has_unfinished:
        result = workers.run(scheduler.schedule())
        if step == 3:
            os.kill(proc.pid, signal.SIGSTOP)
        try:
            collect(trace, scheduler.process_result(result))
        except StateStoreError:
            failures += 1
            os.kill(proc.pid, signal.SIGCONT)  # Redis comes back; buffered writes go next step
        step += 1
    assert failures == 1
    expected = {r.request_id: expected_output(r, config.max_model_len) for r in requests}
    assert trace.outputs == expected
    for request_id, tokens in expected.items():
        assert store.read_tokens(request_id) == tokens


def _running(scheduler: Scheduler, request_id: str, num_tokens: int) -> None:
    """Admits `request_id` and gives it `num_tokens` output tokens."""
    scheduler.add_request(make_request(request_id, 4, 32, ignore_eos=True))
    for token in range(num_tokens):
        plan = scheduler.schedule()
        scheduler.process_result(StepResult(plan.step_id, [request_id], [10 + token]))


def test_store_emptied_under_a_live_scheduler_is_rewritten_from_memory(store, redis_url):
    scheduler = Scheduler(make_config(), store)
    _running(scheduler, "a", 3)
    client = redis.Redis.from_url(redis_url)
    client.flushdb()  # Redis came back empty
    plan = scheduler.schedule()
    scheduler.process_result(StepResult(plan.step_id, ["a"], [13]))  # notices, rewrites
    assert store.read_tokens("a") == [10, 11, 12, 13]
    assert store.read_state("a") is RequestStatus.RUNNING
    assert [r.request_id for r in Scheduler.recover(make_config(), store).requests.values()] == [
        "a"
    ]


def test_store_stale_snapshot_is_rewritten_and_what_finished_meanwhile_is_closed(store, redis_url):
    scheduler = Scheduler(make_config(), store)
    _running(scheduler, "live", 2)
    _running(scheduler, "done", 1)
    client = redis.Redis.from_url(redis_url)
    snapshot = {k: client.dump(k) for k in client.scan_iter()}
    assert client.zcard("conveyor:unfinished") == 2
    scheduler.abort_request("done")  # finishes after the snapshot
    scheduler.outputs.flush()
    client.flushdb()
    for key, value in snapshot.items():  # Redis restarted from the older snapshot
        client.restore(key, 0, value)
    store._run_id = "another instance"  # what INFO's run_id says after a restart
    with pytest.raises(StoreLost, match="restarted"):
        store.check()
    scheduler.outputs.rewrite(StoreLost("restarted"))
    assert store.read_tokens("live") == [10, 11]
    assert store.read_state("done") is RequestStatus.FINISHED_ABORTED
    assert client.ttl("{req:done}:meta") > 0
    assert client.zrange("conveyor:unfinished", 0, -1) == [b"live"]


def test_store_a_reused_id_waits_for_the_old_requests_last_tokens():
    """During an outage the old request's finish stays buffered; a new request with its id
    must not receive them (or merge its writes into the old keys)."""
    down = RedisStateStore(f"redis://127.0.0.1:{free_port()}/0", timeout_s=0.2)
    scheduler = Scheduler(make_config(), None)
    scheduler.add_request(make_request("x", 4, 1))
    scheduler.outputs.store = down
    plan = scheduler.schedule()
    with pytest.raises(StateStoreError):
        scheduler.process_result(StepResult(plan.step_id, ["x"], [5]))  # finished, buffered
    with pytest.raises(RequestExists, match="not persisted yet"):
        scheduler.add_request(make_request("x", 4, 1))


def test_store_keeps_every_eos_id_and_reads_records_with_one(store, redis_url):
    store.add(make_request("many", 4, 5, eos_token_ids=(2, 9)))
    store.add(make_request("old", 4, 5))
    # A record written before requests kept every EOS id holds `eos_token_id` alone.
    client = redis.Redis.from_url(redis_url)
    spec = json.loads(client.hget(meta_key("old"), "spec"))
    del spec["eos_token_ids"]
    client.hset(meta_key("old"), "spec", json.dumps({**spec, "eos_token_id": 7}))
    loaded = {r.request_id: r for r in store.load_unfinished()}
    assert loaded["many"].eos_token_ids == (2, 9)
    assert loaded["old"].eos_token_ids == (7,)


def test_store_a_batch_written_in_a_thread_while_the_next_step_buffers(store):
    """The service writes a step's batch in a thread while it processes the next: the
    second batch goes after the first, each delta once, in order, and the id stays taken
    while either is unwritten."""
    scheduler = Scheduler(make_config(), store)
    _running(scheduler, "a", 2)  # tokens 10, 11 written
    outputs = scheduler.outputs
    plan = scheduler.schedule()
    scheduler.apply_result(StepResult(plan.step_id, ["a"], [12]))
    batch = outputs.take()
    writer = threading.Thread(target=outputs.write, args=(batch,))
    writer.start()
    plan = scheduler.schedule()  # the next step, meanwhile
    scheduler.apply_result(StepResult(plan.step_id, ["a"], [13]))
    writer.join()
    assert outputs.is_writing and outputs.has_pending("a")
    first = outputs.done(batch)
    assert [(d.offset, d.token_ids) for d in first] == [(2, [12])]
    assert store.read_tokens("a") == [10, 11, 12]
    second = outputs.flush()
    assert [(d.offset, d.token_ids) for d in second] == [(3, [13])]
    assert store.read_tokens("a") == [10, 11, 12, 13]
    assert not outputs.has_pending("a") and not outputs.pending_updates()


def test_store_a_batch_given_back_goes_first_with_what_came_since(store):
    """A write that failed puts its batch back in front of what was buffered meanwhile:
    one delta per request, its tokens in order, the latest state on top (the abort; its
    stream's last delta is the service's)."""
    scheduler = Scheduler(make_config(), store)
    _running(scheduler, "a", 1)
    scheduler.add_request(make_request("b", 4, 32, ignore_eos=True))
    outputs = scheduler.outputs
    plan = scheduler.schedule()
    scheduler.apply_result(StepResult(plan.step_id, ["a", "b"], [11, 20]))
    batch = outputs.take()
    plan = scheduler.schedule()
    scheduler.apply_result(StepResult(plan.step_id, ["a", "b"], [12, 21]))
    scheduler.abort_request("b")
    outputs.give_back(batch)  # as after a refused write
    assert not outputs.is_writing
    deltas = {d.request_id: d for d in outputs.flush()}
    assert (deltas["a"].offset, deltas["a"].token_ids) == (1, [11, 12])
    assert (deltas["b"].offset, deltas["b"].token_ids) == (0, [20, 21])
    assert store.read_tokens("a") == [10, 11, 12] and store.read_tokens("b") == [20, 21]
    assert store.read_state("b") is RequestStatus.FINISHED_ABORTED


def test_store_lost_under_a_batch_in_flight_is_rewritten_with_it(store, redis_url):
    scheduler = Scheduler(make_config(), store)
    _running(scheduler, "a", 2)
    outputs = scheduler.outputs
    plan = scheduler.schedule()
    scheduler.apply_result(StepResult(plan.step_id, ["a"], [12]))
    batch = outputs.take()
    redis.Redis.from_url(redis_url).flushdb()  # Redis came back empty
    with pytest.raises(StoreLost):
        outputs.write(batch)
    outputs.give_back(batch)
    deltas = outputs.flush()  # notices again, rewrites from memory
    assert [(d.offset, d.token_ids) for d in deltas] == [(2, [12])]
    assert store.read_tokens("a") == [10, 11, 12]

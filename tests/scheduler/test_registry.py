"""Announcements and adoption in a real Redis (services/scheduler/registry.py, store.py)."""

from __future__ import annotations

import time

import pytest
import redis

from services.common.pipelines import Announcement, announcement_key, read_announcements
from services.common.sampling import SamplingParams
from services.scheduler.registry import PipelineRegistry
from services.scheduler.request import Request, RequestStatus
from services.scheduler.scheduler import Scheduler
from services.scheduler.state import RequestUpdate
from services.scheduler.store import RedisStateStore, meta_key


@pytest.fixture()
def client(redis_url):
    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    return client


def request(request_id: str) -> Request:
    return Request(request_id, [1, 2, 3], SamplingParams(max_tokens=8))


def announce(registry: PipelineRegistry, serving: bool, ttl_s: float = 5.0, **fields) -> None:
    ann = Announcement(registry.pipeline_id, f"127.0.0.1:{len(registry.pipeline_id)}", serving)
    for name, value in fields.items():
        setattr(ann, name, value)
    registry.announce(ann, ttl_s)


def expire_announcement(client, pipeline_id: str) -> None:
    """`pipeline_id`'s announcement expires now, as a TTL does when its scheduler stops
    announcing (a short TTL and a sleep raced a starved test process)."""
    client.pexpire(announcement_key(pipeline_id), 1)
    while client.exists(announcement_key(pipeline_id)):
        time.sleep(0.005)


def test_announcement_round_trips_with_its_prefix_hashes(redis_url, client):
    registry = PipelineRegistry(redis_url, "p0")
    announce(
        registry,
        True,
        num_waiting=3,
        kv_usage=0.25,
        block_size=16,
        prefix_hashes=frozenset({-5, 2**62}),
    )
    (ann,) = read_announcements(client)
    assert (ann.pipeline_id, ann.serving, ann.num_waiting, ann.kv_usage) == ("p0", True, 3, 0.25)
    assert ann.prefix_hashes == {-5, 2**62} and ann.block_size == 16
    assert 0.0 <= ann.age_s < 60.0


def test_announcement_age_is_read_by_redis_clock(redis_url, client):
    """A router learns how old an announcement is (Redis' clock stamps and reads it), so it
    can tell which of its own streams ended after the announced queue was counted."""
    announce(PipelineRegistry(redis_url, "p0"), True)
    (fresh,) = read_announcements(client)
    (seconds, micros) = client.time()
    client.hset("conveyor:pipeline:p0", "announced_at", repr(seconds + micros / 1e6 - 7.0))
    (old,) = read_announcements(client)
    assert fresh.age_s < 7.0 <= old.age_s < 60.0


def test_each_pipeline_recovers_only_its_own_requests(redis_url, client):
    p0 = RedisStateStore(redis_url, pipeline_id="p0")
    p1 = RedisStateStore(redis_url, pipeline_id="p1")
    p0.add(request("a"))
    p1.add(request("b"))
    assert [r.request_id for r in p0.load_unfinished()] == ["a"]
    assert [r.request_id for r in p1.load_unfinished()] == ["b"]
    assert p0.read_owner_pipeline("b") == "p1"


def test_expired_pipeline_is_adopted_and_its_writes_are_fenced(redis_url, client):
    lost_store = RedisStateStore(redis_url, pipeline_id="p1")
    lost_store.add(request("a"))
    lost_store.apply([RequestUpdate("a", RequestStatus.RUNNING, offset=0, token_ids=[7, 8])])
    lost, adopter = PipelineRegistry(redis_url, "p1"), PipelineRegistry(redis_url, "p0")
    announce(lost, True)
    announce(adopter, True)
    assert adopter.adopt("p1", grace_s=60) == []  # still announced and serving
    expire_announcement(client, "p1")
    assert adopter.lost_pipelines(grace_s=60) == ["p1"]
    assert adopter.adopt("p1", grace_s=60) == ["a"]
    assert adopter.adopt("p1", grace_s=60) == []  # taken once only
    (adopted,) = RedisStateStore(redis_url, pipeline_id="p0").load_unfinished()
    assert adopted.output_token_ids == [7, 8] and adopted.status is RequestStatus.WAITING
    # The lost scheduler, back, cannot write the request any more; it is told to drop it.
    lost_store.apply([RequestUpdate("a", offset=2, token_ids=[9])])
    assert lost_store.take_moved() == {"a"}
    assert lost_store.read_tokens("a") == [7, 8]
    assert client.hget(meta_key("a"), "owner") == b"p0"
    assert client.smembers("conveyor:pipelines") == {b"p0"}


def test_a_lost_scheduler_back_streams_none_of_the_tokens_it_could_not_write(redis_url, client):
    """A pipeline judged lost while it was only stalled (its announcement expired) comes
    back with a step's tokens: the store refuses them, and none is streamed, so no client
    holds a token the adopter lacks (a resume there would find fewer tokens than it saw)."""
    from services.common.step import StepResult
    from tests.scheduler.utils import make_config, make_request

    store = RedisStateStore(redis_url, pipeline_id="p1")
    scheduler = Scheduler(make_config(), store)
    scheduler.add_request(make_request("a", 4, 32, ignore_eos=True))
    scheduler.add_request(make_request("b", 4, 32, ignore_eos=True))
    plan = scheduler.schedule()
    scheduler.process_result(StepResult(plan.step_id, ["a", "b"], [10, 20]))
    lost, adopter = PipelineRegistry(redis_url, "p1"), PipelineRegistry(redis_url, "p0")
    announce(lost, True)
    expire_announcement(client, "p1")
    assert adopter.adopt("p1", grace_s=60) == ["a", "b"]
    client.hset(meta_key("b"), "owner", "p1")  # b stays the lost one's (as if never moved)
    outputs = scheduler.outputs
    plan = scheduler.schedule()
    scheduler.apply_result(StepResult(plan.step_id, ["a", "b"], [11, 21]))
    deltas = outputs.flush()
    assert [(d.request_id, d.offset, d.token_ids) for d in deltas] == [("b", 1, [21])]
    assert store.take_moved() == {"a"}
    assert store.read_tokens("a") == [10] and store.read_tokens("b") == [20, 21]


def test_not_serving_pipeline_is_adopted_after_the_grace_only(redis_url, client):
    RedisStateStore(redis_url, pipeline_id="p1").add(request("a"))
    lost, adopter = PipelineRegistry(redis_url, "p1"), PipelineRegistry(redis_url, "p0")
    announce(lost, False)
    assert adopter.adopt("p1", grace_s=60) == []
    since = float(client.hget(announcement_key("p1"), "not_serving_since"))
    client.hset(announcement_key("p1"), "not_serving_since", repr(since - 61))  # a minute ago
    announce(lost, False)  # still NOT_SERVING: the first time counts
    assert adopter.adopt("p1", grace_s=60) == ["a"]
    assert client.smembers("conveyor:pipelines") == {b"p1"}  # announced: it stays listed


def test_an_id_running_on_another_pipeline_is_refused(redis_url, client):
    from services.common.errors import RequestExists

    p0 = RedisStateStore(redis_url, pipeline_id="p0")
    p1 = RedisStateStore(redis_url, pipeline_id="p1")
    p1.add(request("a"))
    with pytest.raises(RequestExists, match="pipeline p1"):
        p0.add(request("a"))
    assert client.hget(meta_key("a"), "owner") == b"p1"
    p1.apply([RequestUpdate("a", RequestStatus.FINISHED_STOPPED)])
    p0.add(request("a"))  # finished there: the id is free again
    assert client.hget(meta_key("a"), "owner") == b"p0"


def test_a_submission_that_ran_elsewhere_is_refused_when_it_comes_again(redis_url, client):
    """A scheduler stopped with a Submit unread reads it on waking, after the router sent it
    again to another pipeline, where it may have finished: the same submission (its owner
    token) does not run twice. Another submission of the id may, once the first finished."""
    from services.common.errors import RequestExists

    p0 = RedisStateStore(redis_url, pipeline_id="p0")
    p1 = RedisStateStore(redis_url, pipeline_id="p1")
    submission = Request("a", [1, 2, 3], SamplingParams(max_tokens=8), owner_token="t1")
    p0.add(submission)
    p0.apply([RequestUpdate("a", RequestStatus.FINISHED_LENGTH)])
    with pytest.raises(RequestExists, match="ran already .* pipeline p0"):
        p1.add(Request("a", [1, 2, 3], SamplingParams(max_tokens=8), owner_token="t1"))
    assert client.hget(meta_key("a"), "owner") == b"p0"
    p1.add(Request("a", [1, 2, 3], SamplingParams(max_tokens=8), owner_token="t2"))
    assert client.hget(meta_key("a"), "owner") == b"p1"

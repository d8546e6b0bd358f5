"""Routing policies (pure): which pipeline a prompt goes to."""

from __future__ import annotations

from services.common.prefix_hash import prompt_block_hashes
from services.router.routing import ENDED_HORIZON_S, PipelineView, Router
from services.scheduler.block_manager import BlockManager

SALT = "tenant:default"
BLOCK = 4


def views(**overrides) -> list[PipelineView]:
    found = [PipelineView(key, serving=True, block_size=BLOCK) for key in ("a", "b", "c")]
    for key, fields in overrides.items():
        view = next(v for v in found if v.key == key)
        for name, value in fields.items():
            setattr(view, name, value)
    return found


def test_round_robin_takes_serving_pipelines_in_turn():
    router = Router("round-robin")
    pool = views(b={"serving": False})
    picked = [router.choose(pool, [1, 2, 3], SALT).key for _ in range(4)]
    assert picked == ["a", "c", "a", "c"]


def test_no_serving_pipeline_is_none():
    assert (
        Router("prefix").choose(
            views(a={"serving": False}, b={"serving": False}, c={"serving": False}), [1], SALT
        )
        is None
    )


def test_least_load_picks_the_emptiest():
    router = Router("least-load")
    pool = views(a={"num_inflight": 3}, b={"num_queued": 5}, c={"num_inflight": 1})
    assert router.choose(pool, [1, 2], SALT).key == "c"


def test_announced_queue_less_this_routers_streams_ended_since():
    """The announcement lags: a stream of this router that was in the announced queue and
    has ended since no longer weighs on the pipeline; one opened after it never did."""
    view = PipelineView("a", serving=True)
    view.num_inflight = 2  # opened at 1.0 and 3.0
    view.announced(num_queued=5, written_at=2.0)  # counts the first, not the second
    assert view.load == 5
    view.stream_ended(opened=1.0, now=4.0)
    assert view.load == 4
    view.stream_ended(opened=3.0, now=4.5)  # not in the announced queue: nothing to take off
    assert view.load == 4
    view.announced(num_queued=3, written_at=4.2)  # after the first ended, the second ran
    assert view.load == 2
    view.announced(num_queued=1, written_at=5.0)  # written after both ended
    assert view.load == 1 and not view.ended


def test_ended_streams_are_forgotten_past_the_horizon():
    """A pipeline that never announces (a static --schedulers one) keeps no growing record."""
    view = PipelineView("a", serving=True)
    for i in range(1000):
        view.num_inflight += 1
        view.stream_ended(opened=float(i), now=i + 0.5)
    assert len(view.ended) <= ENDED_HORIZON_S + 1 and view.num_ended_queued == 0
    view.announced(num_queued=3, written_at=998.0)  # counts the streams open at 998
    assert view.load == 3 - 1  # the one opened at 998 ended at 998.5


def test_stale_queue_does_not_steer_new_prompts_of_one_client():
    """One client's prompts one after the other, each ended before the next: `a` announced
    its queue once, while its first stream ran, and not since (announcements lag by up to a
    second or two); `b` announces after each stream. New prefixes still alternate: counting
    `a`'s ended stream as queued would send every later prompt to `b`, whose prefix cache
    would then evict what it holds."""
    router = Router("prefix")
    a, b, _ = pool = views(c={"serving": False})
    picked = []
    for i in range(6):
        opened = 10.0 * i
        view = router.choose(pool, list(range(100 * i, 100 * i + 40)), SALT)
        picked.append(view.key)
        view.num_inflight += 1
        if i == 0:
            view.announced(num_queued=1, written_at=opened + 1.0)
        view.stream_ended(opened, now=opened + 2.0)
        if view is b:
            view.announced(num_queued=0, written_at=opened + 3.0)
    assert picked == ["a", "b"] * 3


def test_another_routers_ended_stream_does_not_steer_new_prompts():
    """`b` announced one stream queued, another router's, which has ended since (this
    router cannot know): new prefixes of one client still alternate, and do not all go to
    `a` until `b` announces again (a CI run's prefix caches thrashed on that)."""
    router = Router("prefix")
    a, b, _ = pool = views(c={"serving": False})
    b.announced(num_queued=1, written_at=0.0)
    picked = [router.choose(pool, list(range(100 * i, 100 * i + 40)), SALT).key for i in range(6)]
    assert picked == ["a", "b"] * 3


def test_a_pipeline_loaded_by_two_streams_more_gets_new_prefixes_elsewhere():
    router = Router("prefix")
    pool = views(b={"num_inflight": 2}, c={"serving": False})
    picked = [router.choose(pool, list(range(100 * i, 100 * i + 40)), SALT).key for i in range(4)]
    assert picked == ["a"] * 4


def test_prefix_hashes_equal_the_scheduler_cache():
    """The router's hashes of a prompt are the ones the scheduler's cache registers."""
    prompt = list(range(100, 123))  # 23 tokens: 5 full blocks, the walk looks at 5
    manager = BlockManager(num_blocks=16, block_size=BLOCK)
    manager.allocate("r", len(prompt), extra_key=SALT)
    manager.cache_full_blocks("r", prompt, len(prompt))
    cached = set(manager.recent_block_hashes(100))
    assert (
        prompt_block_hashes(prompt, BLOCK, SALT)
        == manager.find_cached_prefix(prompt, SALT).block_hashes
    )
    assert set(prompt_block_hashes(prompt, BLOCK, SALT)) <= cached
    assert not set(prompt_block_hashes(prompt, BLOCK, "tenant:other")) & cached


def test_prefix_goes_where_the_longest_prefix_is_cached():
    prompt = list(range(1, 40))
    hashes = prompt_block_hashes(prompt, BLOCK, SALT)
    pool = views(
        a={"prefix_hashes": frozenset(hashes[:2])}, c={"prefix_hashes": frozenset(hashes[:7])}
    )
    assert Router("prefix").choose(pool, prompt, SALT).key == "c"


def test_prefix_match_must_start_at_the_first_block():
    prompt = list(range(1, 40))
    hashes = prompt_block_hashes(prompt, BLOCK, SALT)
    pool = views(
        b={"prefix_hashes": frozenset(hashes[1:])}, c={"prefix_hashes": frozenset(hashes[:1])}
    )
    assert Router("prefix").choose(pool, prompt, SALT).key == "c"


def test_a_hot_prefix_spills_over_when_its_pipeline_is_loaded():
    """9 cached blocks are worth 18 queued requests at weight 0.5: past that, elsewhere."""
    prompt = list(range(1, 41))
    hashes = frozenset(prompt_block_hashes(prompt, BLOCK, SALT))
    router = Router("prefix", load_weight=0.5)
    assert (
        router.choose(views(a={"prefix_hashes": hashes, "num_inflight": 10}), prompt, SALT).key
        == "a"
    )
    assert (
        router.choose(views(a={"prefix_hashes": hashes, "num_inflight": 30}), prompt, SALT).key
        != "a"
    )


def test_prefix_remembers_where_it_sent_a_prefix():
    """Before any announcement lists it, a prefix sticks to the pipeline it was sent to."""
    router = Router("prefix")
    pool = views()
    first = router.choose(pool, list(range(1, 30)) + [7], SALT).key
    again = [router.choose(pool, list(range(1, 30)) + [t], SALT).key for t in (8, 9, 10)]
    assert again == [first] * 3

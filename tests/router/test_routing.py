"""Routing policies (pure): which pipeline a prompt goes to."""

from __future__ import annotations

from services.common.prefix_hash import prompt_block_hashes
from services.router.routing import PipelineView, Router
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

"""KV block pool: ownership, ref counts, prefix cache and eviction."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from services.common.errors import OutOfBlocks
from services.scheduler.block_manager import BlockManager

BLOCK_SIZE = 4


class BlockManagerMachine(RuleBasedStateMachine):
    """Random allocate / grow / free / prefix-hit sequences against the invariants."""

    def __init__(self):
        super().__init__()
        self.bm = BlockManager(num_blocks=24, block_size=BLOCK_SIZE)
        self.live: dict[str, list[int]] = {}  # request id -> its tokens
        self.num_slots: dict[str, int] = {}
        self.counter = 0

    # Prompts from a tiny alphabet over shared stems, so prefix hits are frequent.
    @rule(
        stem=st.sampled_from([(), (1, 2, 3, 4), (1, 2, 3, 4, 5, 6, 7, 8), (9,) * 8]),
        tail=st.lists(st.integers(0, 2), max_size=9),
        extra_key=st.sampled_from([None, "lora-a"]),
    )
    def add(self, stem, tail, extra_key):
        tokens = [*stem, *tail] or [0]
        request_id = f"r{self.counter}"
        self.counter += 1
        prefix = self.bm.find_cached_prefix(tokens, extra_key)
        num_cached = prefix.num_tokens(BLOCK_SIZE)
        assert num_cached < len(tokens), "a prefix hit must leave the last token to compute"
        for i, block_id in enumerate(prefix.block_ids):  # hit content matches the prompt
            assert self.bm.blocks[block_id].token_ids == tuple(tokens[i * 4 : i * 4 + 4])
        if not self.bm.can_allocate(request_id, len(tokens), prefix):
            with pytest.raises(OutOfBlocks):
                self.bm.allocate(request_id, len(tokens), prefix, extra_key)
            return
        self.bm.allocate(request_id, len(tokens), prefix, extra_key)
        self.bm.cache_full_blocks(request_id, tokens, len(tokens))
        self.live[request_id] = tokens
        self.num_slots[request_id] = len(tokens)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), num_new=st.integers(1, 6))
    def grow(self, data, num_new):
        request_id = data.draw(st.sampled_from(sorted(self.live)))
        tokens = self.live[request_id]
        if not self.bm.can_allocate(request_id, len(tokens) + num_new):
            return
        table_before = list(self.bm.block_table(request_id))
        self.bm.allocate(request_id, len(tokens) + num_new)
        assert self.bm.block_table(request_id)[: len(table_before)] == table_before
        tokens.extend(data.draw(st.lists(st.integers(0, 2), min_size=num_new, max_size=num_new)))
        self.bm.cache_full_blocks(request_id, tokens, len(tokens))
        self.num_slots[request_id] = len(tokens)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data):
        request_id = data.draw(st.sampled_from(sorted(self.live)))
        self.bm.free(request_id)
        del self.live[request_id]
        del self.num_slots[request_id]

    @invariant()
    def ownership(self):
        owners: dict[int, int] = {}
        for request_id in self.live:
            table = self.bm.block_table(request_id)
            assert len(table) == len(set(table))
            assert len(table) * BLOCK_SIZE >= self.num_slots[request_id]
            for block_id in table:
                owners[block_id] = owners.get(block_id, 0) + 1
        for block in self.bm.blocks:
            assert block.ref_count == owners.get(block.block_id, 0)
            if block.ref_count > 1:  # shared only through the prefix cache
                assert block.block_hash is not None
        assert self.bm.num_free_blocks + len(owners) == self.bm.num_blocks

    def teardown(self):
        for request_id in list(self.live):
            self.bm.free(request_id)
        assert self.bm.num_free_blocks == self.bm.num_blocks
        assert all(b.ref_count == 0 for b in self.bm.blocks)


TestBlockManagerProperties = BlockManagerMachine.TestCase
TestBlockManagerProperties.settings = settings(max_examples=150, stateful_step_count=40)


def test_block_manager_prefix_hit_skips_full_blocks_but_not_last_token():
    bm = BlockManager(num_blocks=8, block_size=4)
    bm.allocate("a", 8, bm.find_cached_prefix(list(range(8))))
    bm.cache_full_blocks("a", list(range(8)), 8)
    # Same 8 tokens: only the first block may be reused, the last token is computed again.
    assert bm.find_cached_prefix(list(range(8))).num_tokens(4) == 4
    assert bm.find_cached_prefix(list(range(9))).num_tokens(4) == 8
    assert bm.find_cached_prefix([0, 1, 2, 99, 4]).num_tokens(4) == 0
    assert bm.find_cached_prefix(list(range(9)), extra_key="adapter").num_tokens(4) == 0


def test_block_manager_reuses_freed_cached_blocks_until_evicted_oldest_first():
    bm = BlockManager(num_blocks=4, block_size=2)
    for name, tokens in (("old", [1, 2, 3]), ("new", [5, 6, 7])):
        bm.allocate(name, 3, bm.find_cached_prefix(tokens))
        bm.cache_full_blocks(name, tokens, 3)
        bm.free(name)
    assert bm.find_cached_prefix([5, 6, 7]).num_tokens(2) == 2
    bm.allocate("x", 6, bm.find_cached_prefix([0] * 6))  # needs 3 fresh blocks of 4
    assert bm.find_cached_prefix([1, 2, 3]).num_tokens(2) == 0  # oldest evicted
    assert bm.find_cached_prefix([5, 6, 7]).num_tokens(2) == 2  # newest kept
    stats = bm.stats()
    assert stats.prefix_hit_rate == 0.0 and stats.num_cached_blocks == 1


def test_block_manager_hit_rate_usage_and_fragmentation():
    bm = BlockManager(num_blocks=10, block_size=4)
    bm.allocate("a", 9, bm.find_cached_prefix(list(range(9))))
    bm.cache_full_blocks("a", list(range(9)), 9)
    bm.allocate("b", 9, bm.find_cached_prefix(list(range(9))))
    stats = bm.stats()
    assert stats.prefix_hit_rate == pytest.approx(8 / 18)
    assert stats.usage == pytest.approx(4 / 10)  # 2 shared + 1 partial each
    assert stats.fragmentation == pytest.approx(6 / 16)


def test_block_manager_without_prefix_caching_never_shares():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    bm.allocate("a", 9, bm.find_cached_prefix(list(range(9))))
    bm.cache_full_blocks("a", list(range(9)), 9)
    prefix = bm.find_cached_prefix(list(range(9)))
    assert prefix.block_ids == []
    bm.allocate("b", 9, prefix)
    assert not set(bm.block_table("a")) & set(bm.block_table("b"))


def test_block_manager_refuses_what_does_not_fit_and_changes_nothing():
    bm = BlockManager(num_blocks=2, block_size=4)
    bm.allocate("a", 5)
    with pytest.raises(OutOfBlocks, match="needs 1 more KV blocks but 0 are free"):
        bm.allocate("b", 1)
    assert bm.num_free_blocks == 0 and not bm.has("b")

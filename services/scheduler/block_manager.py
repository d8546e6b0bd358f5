"""Paged KV block pool with prefix caching (vLLM v1 / nano-vllm style).

One pool of `num_blocks` blocks of `block_size` token slots is shared by all pipeline stages:
block id b names the same slots in every stage's own KV cache (each stage holds its layers).

Block math, block_size = 4, a request with 10 tokens computed and 1 optimistic slot::

    token positions   0 1 2 3 | 4 5 6 7 | 8 9 10 .
    block table       [  7    ,   2     ,   9      ]      ceil(11 / 4) = 3 blocks
                        full      full    partial: 1 free slot (fragmentation)
    chain hashes      h0=H(root,  t0..3)
                      h1=H(h0,    t4..7)                  only full, known blocks are hashed
    slot of token p   block_table[p // 4] * 4 + p % 4     (the workers' slot_mapping)

A full block is identified by its chain hash: the hash of its parent block's hash, its token
ids and the request's extra key (root). A new request walks its prompt block by block; every
block whose hash is cached (and whose stored tokens equal the prompt's: no trust in hash
collisions) is reused, and those tokens are not computed again. The walk stops one token
short of the prompt so that the last prompt token is always computed (its logits are needed).

Ref counts: a block is referenced once by every live request whose table holds it. A block
whose count drops to 0 goes to the free list; if it is cached it stays findable by its hash
until a fresh block is needed and it is evicted, least recently freed first. Uncached free
blocks are taken before any cached one. Block tables only grow until the request is freed.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from services.common.errors import OutOfBlocks, UnknownRequest
from services.common.prefix_hash import chain_hash, root_hash

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None
    """Chain hash while the block is registered in the prefix cache."""
    token_ids: tuple[int, ...] | None = None
    """Content of a cached block, compared on every hit."""


@dataclass(slots=True)
class CachedPrefix:
    """The longest cached prefix of a token sequence (empty when nothing is cached)."""

    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)
    num_queried_tokens: int = 0

    def num_tokens(self, block_size: int) -> int:
        return len(self.block_ids) * block_size


@dataclass(slots=True)
class BlockStats:
    num_blocks: int
    num_free_blocks: int
    num_cached_blocks: int
    """Blocks findable in the prefix cache (in use or free)."""
    usage: float
    """Fraction of blocks referenced by a live request."""
    prefix_hit_rate: float
    """Prompt tokens found in the cache / prompt tokens looked up."""
    fragmentation: float
    """Allocated slots holding no token / allocated slots."""


@dataclass(slots=True)
class _Seq:
    block_ids: list[int]
    block_hashes: list[int]
    """Chain hashes of this sequence's full blocks hashed so far."""
    num_slots: int
    root_hash: int


class BlockManager:
    """Owns the block pool, each request's block table and the prefix cache."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[int, int] = {}  # chain hash -> block id
        self._seqs: dict[str, _Seq] = {}
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0
        self.cache_epoch = 0
        """Salts every chain hash: a new epoch (new weights) makes every block cached before
        it unfindable, while requests still holding those blocks keep them."""

    # -- lookups ---------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def has(self, request_id: str) -> bool:
        return request_id in self._seqs

    def block_table(self, request_id: str) -> list[int]:
        return self._seq(request_id).block_ids

    def find_cached_prefix(
        self, token_ids: Sequence[int], extra_key: str | None = None
    ) -> CachedPrefix:
        """Longest cached prefix of `token_ids`, leaving at least its last token to compute."""
        prefix = CachedPrefix(num_queried_tokens=len(token_ids))
        if not self.enable_prefix_caching:
            return prefix
        size = self.block_size
        parent = root_hash(extra_key, self.cache_epoch)
        for i in range((len(token_ids) - 1) // size):
            tokens = tuple(token_ids[i * size : (i + 1) * size])
            parent = chain_hash(parent, tokens)
            block_id = self._cached.get(parent)
            if block_id is None or self.blocks[block_id].token_ids != tokens:
                break
            prefix.block_ids.append(block_id)
            prefix.block_hashes.append(parent)
        return prefix

    # -- allocate / free -------------------------------------------------------------------
    def num_blocks_needed(
        self, request_id: str, num_slots: int, prefix: CachedPrefix | None = None
    ) -> int:
        """Free blocks that `allocate(request_id, num_slots, prefix)` would take."""
        seq = self._seqs.get(request_id)
        have = len(seq.block_ids) if seq else 0
        taken = 0
        if seq is None and prefix is not None and prefix.block_ids:
            have = len(prefix.block_ids)
            taken = sum(1 for b in prefix.block_ids if self.blocks[b].ref_count == 0)
        return max(0, -(-num_slots // self.block_size) - have) + taken

    def can_allocate(
        self, request_id: str, num_slots: int, prefix: CachedPrefix | None = None
    ) -> bool:
        """Whether the request's table can grow to hold `num_slots` token slots."""
        return self.num_blocks_needed(request_id, num_slots, prefix) <= len(self._free)

    def allocate(
        self,
        request_id: str,
        num_slots: int,
        prefix: CachedPrefix | None = None,
        extra_key: str | None = None,
    ) -> list[int]:
        """Grow the request's table to `num_slots` slots; return the block ids appended.

        The first call creates the table, starting with `prefix`'s cached blocks (which are
        returned too: they are new to the request). Raises `OutOfBlocks` when the pool cannot
        hold it; nothing changes then.
        """
        seq = self._seqs.get(request_id)
        if seq is not None:  # hot path: a running request grows by a token or a chunk
            num_needed = -(-num_slots // self.block_size) - len(seq.block_ids)
            new_ids = []
            if num_needed > 0:
                if num_needed > len(self._free):
                    raise self._out_of_blocks(request_id, num_needed)
                new_ids = [self._pop_free_block() for _ in range(num_needed)]
                seq.block_ids.extend(new_ids)
            if num_slots > seq.num_slots:
                seq.num_slots = num_slots
            return new_ids
        if not self.can_allocate(request_id, num_slots, prefix):
            needed = self.num_blocks_needed(request_id, num_slots, prefix)
            raise self._out_of_blocks(request_id, needed)
        seq = self._seqs[request_id] = _Seq([], [], 0, root_hash(extra_key, self.cache_epoch))
        new_ids = []
        if prefix is not None:
            self._take_prefix(seq, prefix)
            new_ids.extend(prefix.block_ids)
        for _ in range(-(-num_slots // self.block_size) - len(seq.block_ids)):
            block_id = self._pop_free_block()
            seq.block_ids.append(block_id)
            new_ids.append(block_id)
        seq.num_slots = max(seq.num_slots, num_slots)
        return new_ids

    def free(self, request_id: str) -> None:
        """Drop the request's references; its unreferenced blocks become free (cached ones stay
        findable until evicted). Freeing an unknown request is a no-op."""
        seq = self._seqs.pop(request_id, None)
        if seq is None:
            return
        # Tail blocks first: they are the least likely to be shared, so evicted first.
        for block_id in reversed(seq.block_ids):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None
                if block.block_hash is None:
                    self._free.move_to_end(block_id, last=False)

    def cache_full_blocks(self, request_id: str, token_ids: Sequence[int], num_tokens: int) -> None:
        """Register in the prefix cache the request's full blocks within its first
        `num_tokens` tokens (tokens whose KV the planned steps compute)."""
        if not self.enable_prefix_caching:
            return
        seq = self._seq(request_id)
        size = self.block_size
        num_full = min(num_tokens, seq.num_slots, len(token_ids)) // size
        parent = seq.block_hashes[-1] if seq.block_hashes else seq.root_hash
        for i in range(len(seq.block_hashes), num_full):
            tokens = tuple(token_ids[i * size : (i + 1) * size])
            parent = chain_hash(parent, tokens)
            seq.block_hashes.append(parent)
            block = self.blocks[seq.block_ids[i]]
            if block.block_hash is None and parent not in self._cached:
                block.block_hash, block.token_ids = parent, tokens
                self._cached[parent] = block.block_id

    def invalidate_prefix_cache(self) -> None:
        """No block cached so far is found again (the weights that computed them changed);
        they are evicted as free blocks are needed, like any other."""
        self.cache_epoch += 1

    def reset_prefix_cache(self) -> None:
        """Forget every cached block (e.g. after a pipeline restart lost the KV)."""
        for block in self.blocks:
            block.block_hash = block.token_ids = None
        self._cached.clear()
        for seq in self._seqs.values():
            seq.block_hashes.clear()

    def recent_block_hashes(self, limit: int) -> list[int]:
        """Chain hashes of the `limit` most recently cached blocks that are still findable
        (what a pipeline announces to the routers: a bounded set)."""
        if limit <= 0 or not self._cached:
            return []
        hashes = list(self._cached)  # insertion order: the most recently cached last
        return hashes[-limit:]

    # -- stats -----------------------------------------------------------------------------
    def stats(self) -> BlockStats:
        used = self.num_blocks - len(self._free)
        allocated_slots = used * self.block_size
        # Only a table's last block can be partial, and partial blocks are never shared.
        empty = sum(len(s.block_ids) * self.block_size - s.num_slots for s in self._seqs.values())
        return BlockStats(
            num_blocks=self.num_blocks,
            num_free_blocks=len(self._free),
            num_cached_blocks=len(self._cached),
            usage=used / self.num_blocks,
            prefix_hit_rate=self.num_hit_tokens / self.num_queried_tokens
            if self.num_queried_tokens
            else 0.0,
            fragmentation=empty / allocated_slots if allocated_slots else 0.0,
        )

    # -- internals -------------------------------------------------------------------------
    def _seq(self, request_id: str) -> _Seq:
        try:
            return self._seqs[request_id]
        except KeyError:
            raise UnknownRequest(f"request {request_id} holds no KV blocks") from None

    def _out_of_blocks(self, request_id: str, num_needed: int) -> OutOfBlocks:
        return OutOfBlocks(
            f"request {request_id} needs {num_needed} more KV blocks but {len(self._free)} are free"
        )

    def _take_prefix(self, seq: _Seq, prefix: CachedPrefix) -> None:
        for block_id in prefix.block_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self._free[block_id]
            block.ref_count += 1
        seq.block_ids.extend(prefix.block_ids)
        seq.block_hashes.extend(prefix.block_hashes)
        seq.num_slots = len(prefix.block_ids) * self.block_size
        self.num_queried_tokens += prefix.num_queried_tokens
        self.num_hit_tokens += seq.num_slots

    def _pop_free_block(self) -> int:
        block_id, _ = self._free.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:  # evict from the prefix cache
            if self._cached.get(block.block_hash) == block_id:
                del self._cached[block.block_hash]
            block.block_hash = block.token_ids = None
        block.ref_count = 1
        return block_id

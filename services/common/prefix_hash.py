"""The prefix cache's block hashes, shared by the scheduler (its cache) and the routers (which
pipeline holds a prompt's prefix): one definition, so both sides compute the same numbers.

    root      = H("conveyor-kv", extra key, epoch)        stable: blake2b, not Python's hash
    hash[i]   = hash((hash[i-1] or root, tokens of block i))

Python's `hash()` of a str differs between processes (PYTHONHASHSEED), so the root, which
holds the tenant's salt, is a blake2b digest; the chain step hashes a tuple of ints, which is
the same in every process of one Python version (routers and schedulers run one image).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence


def root_hash(extra_key: str | None, epoch: int = 0) -> int:
    """The chain's start for one prefix-cache namespace (a tenant's salt) and weight epoch."""
    text = f"conveyor-kv\0{extra_key if extra_key is not None else ''}\0{epoch}"
    digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


def chain_hash(parent: int, tokens: tuple[int, ...]) -> int:
    """The hash of a full block of `tokens` following the block hashed `parent`."""
    return hash((parent, tokens))


def prompt_block_hashes(
    token_ids: Sequence[int], block_size: int, extra_key: str | None, epoch: int = 0
) -> list[int]:
    """Chain hashes of the prompt's full blocks that a cache lookup walks: all but the last
    token (which is always computed), as `BlockManager.find_cached_prefix` does."""
    parent = root_hash(extra_key, epoch)
    hashes = []
    for i in range((len(token_ids) - 1) // block_size):
        parent = chain_hash(parent, tuple(token_ids[i * block_size : (i + 1) * block_size]))
        hashes.append(parent)
    return hashes

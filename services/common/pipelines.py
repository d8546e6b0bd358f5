"""What a scheduler announces about its pipeline, and how it reads from Redis (pure).

Every scheduler started with --pipeline-id writes, every `announce_interval_s`, one hash
with a TTL (`--announce-ttl`)::

    conveyor:pipelines             set   ids of the pipelines announced (until adopted)
    conveyor:pipeline:<id>         hash  address, serving (1/0), announced_at and
                                         not_serving_since (Redis TIME, s), num_waiting,
                                         num_running, kv_usage,
                                         block_size, cache_epoch, hit/queried token counters,
                                         prefixes: the chain hashes of its most recently cached
                                         KV blocks, packed little-endian int64, at most
                                         --announce-max-blocks of them (a bounded set)

Routers read it to find pipelines, weigh their load and find which one holds a prompt's
prefix; schedulers read it to find a pipeline lost for good and adopt its requests.
"""

from __future__ import annotations

import re
from array import array
from dataclasses import dataclass, field

from services.common.errors import ConfigError

PIPELINES_KEY = "conveyor:pipelines"
_PIPELINE_ID = re.compile(r"\A[A-Za-z0-9._-]{1,64}\Z")


def announcement_key(pipeline_id: str) -> str:
    return f"conveyor:pipeline:{pipeline_id}"


def check_pipeline_id(pipeline_id: str) -> str:
    """Raises ConfigError unless `pipeline_id` is 1 to 64 of [A-Za-z0-9._-]."""
    if not _PIPELINE_ID.match(pipeline_id):
        raise ConfigError(
            f"pipeline id {pipeline_id[:80]!r} is not allowed: 1 to 64 letters, digits, '.', "
            "'_' or '-'"
        )
    return pipeline_id


@dataclass(slots=True)
class Announcement:
    """One pipeline as its scheduler last described it."""

    pipeline_id: str
    address: str
    """HOST:PORT where routers reach its scheduler."""
    serving: bool
    num_waiting: int = 0
    num_running: int = 0
    kv_usage: float = 0.0
    """Fraction of KV blocks held by live requests."""
    block_size: int = 0
    cache_epoch: int = 0
    """Salts the block hashes (a new one after each weight update)."""
    num_prefix_queried_tokens: int = 0
    num_prefix_hit_tokens: int = 0
    prefix_hashes: frozenset[int] = field(default_factory=frozenset)
    """Chain hashes of blocks its prefix cache holds (services/common/prefix_hash.py)."""
    age_s: float = 0.0
    """Seconds from its writing to its reading, by Redis' clock (`read_announcements`)."""

    def to_fields(self) -> dict[str, str | bytes]:
        """The hash fields (serving and not_serving_since are the announce script's)."""
        return {
            "address": self.address,
            "num_waiting": str(self.num_waiting),
            "num_running": str(self.num_running),
            "kv_usage": repr(self.kv_usage),
            "block_size": str(self.block_size),
            "cache_epoch": str(self.cache_epoch),
            "num_prefix_queried_tokens": str(self.num_prefix_queried_tokens),
            "num_prefix_hit_tokens": str(self.num_prefix_hit_tokens),
            "prefixes": pack_hashes(self.prefix_hashes),
        }

    @classmethod
    def from_fields(cls, pipeline_id: str, fields: dict[bytes, bytes]) -> Announcement:
        """Raises ValueError on a malformed announcement (it is then ignored)."""

        def num(name: str, kind=int):
            return kind(fields.get(name.encode(), b"0") or b"0")

        return cls(
            pipeline_id=pipeline_id,
            address=fields[b"address"].decode(),
            serving=fields.get(b"serving") == b"1",
            num_waiting=num("num_waiting"),
            num_running=num("num_running"),
            kv_usage=num("kv_usage", float),
            block_size=num("block_size"),
            cache_epoch=num("cache_epoch"),
            num_prefix_queried_tokens=num("num_prefix_queried_tokens"),
            num_prefix_hit_tokens=num("num_prefix_hit_tokens"),
            prefix_hashes=frozenset(unpack_hashes(fields.get(b"prefixes", b""))),
        )


def pack_hashes(hashes) -> bytes:
    """int64 little-endian, 8 bytes a block."""
    packed = array("q", hashes)
    if packed.itemsize != 8:  # pragma: no cover - every platform Conveyor runs on
        raise RuntimeError("int64 arrays are not 8 bytes here")
    return packed.tobytes()


def unpack_hashes(data: bytes) -> list[int]:
    if len(data) % 8:
        raise ValueError(f"a packed hash list of {len(data)} bytes is not a multiple of 8")
    hashes = array("q")
    hashes.frombytes(data)
    return hashes.tolist()


def read_announcements(client) -> list[Announcement]:
    """Every pipeline announced in Redis right now (`client`: a redis.Redis); expired or
    malformed announcements are skipped."""
    ids = sorted(i.decode() for i in client.smembers(PIPELINES_KEY))
    if not ids:
        return []
    pipe = client.pipeline(transaction=False)
    pipe.time()
    for pipeline_id in ids:
        pipe.hgetall(announcement_key(pipeline_id))
    (seconds, micros), *replies = pipe.execute()
    now = seconds + micros / 1e6
    found = []
    for pipeline_id, fields in zip(ids, replies, strict=True):
        if not fields:
            continue  # expired: lost (its requests are adopted) or not started yet
        try:
            ann = Announcement.from_fields(pipeline_id, fields)
            ann.age_s = max(0.0, now - float(fields.get(b"announced_at") or now))
        except (KeyError, ValueError):
            continue
        found.append(ann)
    return found

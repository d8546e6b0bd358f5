"""A scheduler among many pipelines: it announces itself in Redis and adopts the requests
of a pipeline lost for good (docs/scale-out.md).

Announce (one Lua call every interval): the announcement hash of services/common/pipelines.py
with a TTL; `announced_at` is stamped with Redis' own clock, and `not_serving_since` too the
first time the pipeline says NOT_SERVING, so that every scheduler judges the grace period (and
every router an announcement's age) by one clock.

Adopt (one Lua call, atomic): a pipeline is lost when its announcement expired (its scheduler
is gone) or it has said NOT_SERVING for longer than `grace_s` (its stages are). The script
checks that again inside Redis, then moves every id of the lost pipeline's unfinished index
into the adopter's and writes the adopter's id as each request's `owner`. Two adopters
cannot both take a request: the second finds the index empty. The lost scheduler, should it
come back, is fenced: the store refuses its writes to requests it no longer owns (MOVED).
"""

from __future__ import annotations

import logging

import redis
from redis.backoff import NoBackoff
from redis.exceptions import RedisError
from redis.retry import Retry

from services.common.errors import StateStoreError
from services.common.pipelines import (
    PIPELINES_KEY,
    Announcement,
    announcement_key,
    read_announcements,
)
from services.scheduler.store import index_key

logger = logging.getLogger(__name__)

# KEYS: announcement, pipelines set. ARGV: id, serving (1/0), ttl ms, field, value, ...
_ANNOUNCE_SCRIPT = """
local key = KEYS[1]
local t = redis.call('TIME')
local now = tostring(tonumber(t[1]) + tonumber(t[2]) / 1e6)
if ARGV[2] == '1' then
  redis.call('HSET', key, 'serving', '1', 'not_serving_since', '', 'announced_at', now)
else
  local since = redis.call('HGET', key, 'not_serving_since')
  if not since or since == '' then
    since = now
  end
  redis.call('HSET', key, 'serving', '0', 'not_serving_since', since, 'announced_at', now)
end
for i = 4, #ARGV, 2 do
  redis.call('HSET', key, ARGV[i], ARGV[i + 1])
end
redis.call('PEXPIRE', key, tonumber(ARGV[3]))
redis.call('SADD', KEYS[2], ARGV[1])
return 1
"""

# KEYS: lost announcement, lost index, own index, pipelines set. ARGV: own id, lost id,
# grace s. Returns the ids moved (none when the pipeline is not lost after all).
_ADOPT_SCRIPT = """
local expired = redis.call('EXISTS', KEYS[1]) == 0
if not expired then
  local state = redis.call('HMGET', KEYS[1], 'serving', 'not_serving_since')
  local since = tonumber(state[2])
  if state[1] ~= '0' or not since then return {} end
  local t = redis.call('TIME')
  if tonumber(t[1]) + tonumber(t[2]) / 1e6 - since < tonumber(ARGV[3]) then return {} end
end
local listed = redis.call('ZRANGE', KEYS[2], 0, -1, 'WITHSCORES')
local moved = {}
for i = 1, #listed, 2 do
  local id, arrival = listed[i], listed[i + 1]
  local meta = '{req:' .. id .. '}:meta'
  if redis.call('EXISTS', meta) == 1 then
    redis.call('HSET', meta, 'owner', ARGV[1])
    redis.call('ZADD', KEYS[3], arrival, id)
    moved[#moved + 1] = id
  end
end
redis.call('DEL', KEYS[2])
if expired then redis.call('SREM', KEYS[4], ARGV[2]) end
return moved
"""


class PipelineRegistry:
    """This scheduler's announcements and adoptions (redis-py; every call one round trip)."""

    def __init__(
        self, url: str, pipeline_id: str, timeout_s: float = 2.0, password: str | None = None
    ):
        self.pipeline_id = pipeline_id
        self._client = redis.Redis.from_url(
            url,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0),
            password=password,
        )
        self._announce = self._client.register_script(_ANNOUNCE_SCRIPT)
        self._adopt = self._client.register_script(_ADOPT_SCRIPT)

    def close(self) -> None:
        self._client.close()

    def announce(self, announcement: Announcement, ttl_s: float) -> None:
        args = [self.pipeline_id, "1" if announcement.serving else "0", int(ttl_s * 1000)]
        for name, value in announcement.to_fields().items():
            args += [name, value]
        keys = [announcement_key(self.pipeline_id), PIPELINES_KEY]
        self._call(lambda: self._announce(keys=keys, args=args))

    def lost_pipelines(self, grace_s: float) -> list[str]:
        """Pipelines (not this one) that look lost and still list unfinished requests: the
        candidates to adopt (the script decides)."""

        def read():
            ids = [i.decode() for i in self._client.smembers(PIPELINES_KEY)]
            others = [i for i in ids if i != self.pipeline_id]
            if not others:
                return []
            pipe = self._client.pipeline(transaction=False)
            for other in others:
                pipe.hmget(announcement_key(other), "serving", "not_serving_since")
                pipe.zcard(index_key(other))
            results = pipe.execute()
            lost = []
            for i, other in enumerate(others):
                (serving, since), num_unfinished = results[2 * i], results[2 * i + 1]
                is_down = serving is None or serving == b"0" and since not in (None, b"")
                if is_down and (num_unfinished or serving is None):
                    lost.append(other)
            return lost

        return self._call(read)

    def adopt(self, lost_id: str, grace_s: float) -> list[str]:
        """Moves every unfinished request of `lost_id` to this pipeline if it is lost;
        returns their ids (the caller loads and runs them)."""
        keys = [
            announcement_key(lost_id),
            index_key(lost_id),
            index_key(self.pipeline_id),
            PIPELINES_KEY,
        ]
        args = [self.pipeline_id, lost_id, repr(grace_s)]
        moved = self._call(lambda: self._adopt(keys=keys, args=args))
        return [m.decode() for m in moved]

    def announcements(self) -> list[Announcement]:
        return self._call(lambda: read_announcements(self._client))

    def _call(self, command):
        try:
            return command()
        except RedisError as exc:
            raise StateStoreError(
                f"Redis refused a pipeline announcement or adoption: {exc}"
            ) from exc

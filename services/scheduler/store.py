"""Request state in Redis: the source of truth a restarted scheduler recovers from.

Keys (the `{req:<id>}` hash tag puts both keys of a request in one Redis Cluster slot)::

    {req:<id>}:meta     hash  prompt (packed uint32), spec (JSON: sampling params, tenant,
                              priority, weight, arrival, eos, extra key), state, reason
    {req:<id>}:tokens   list  output token ids, in order (the token log)
    conveyor:unfinished zset  ids of unfinished requests, scored by arrival (its own slot)

One step = one round trip: `apply()` sends a non-transactional pipeline holding one EVALSHA
per changed request (append + state + TTL, atomic per request since both keys share a slot)
and one ZREM of the finished ids. A MULTI could not span slots in a cluster, so there is no
atomicity across requests; what holds instead:

* per request, the token log and state change together or not at all (one Lua script);
* appends are offset-checked: the script appends only the tokens past the log's length, so
  a replayed or re-sent step appends nothing twice, and a gap is refused, never written;
* a finished state is never overwritten; finished keys expire after `finished_ttl_s`;
* the index may briefly list a finished or vanished request (if a pipeline broke halfway):
  `load_unfinished()` checks each id's own state and drops stale entries.

Any Redis failure raises `StateStoreError`; the caller keeps its writes and sends them again.
"""

from __future__ import annotations

import json
import logging
import time
from array import array
from collections.abc import Callable
from dataclasses import asdict

import redis
from redis.backoff import NoBackoff
from redis.exceptions import NoScriptError, RedisError
from redis.retry import Retry

from services.common.errors import StateStoreError
from services.common.sampling import SamplingParams
from services.scheduler.request import Request, RequestStatus
from services.scheduler.state import RequestUpdate

logger = logging.getLogger(__name__)

INDEX_KEY = "conveyor:unfinished"

# KEYS: meta, tokens. ARGV: offset, state ('' = unchanged), reason, ttl (0 = none), tokens...
_APPEND_SCRIPT = """
if redis.call('EXISTS', KEYS[1]) == 0 then return -1 end
local len = redis.call('LLEN', KEYS[2])
local offset = tonumber(ARGV[1])
if len < offset then
  return redis.error_reply('CONVEYOR_GAP ' .. KEYS[2] .. ' holds ' .. len ..
    ' tokens but the append starts at ' .. offset)
end
local first = 5 + len - offset
if first <= #ARGV then redis.call('RPUSH', KEYS[2], unpack(ARGV, first)) end
local state = redis.call('HGET', KEYS[1], 'state')
if ARGV[2] ~= '' and not (state == 'failed' or string.sub(state, 1, 8) == 'finished') then
  redis.call('HSET', KEYS[1], 'state', ARGV[2], 'reason', ARGV[3])
end
local ttl = tonumber(ARGV[4])
if ttl > 0 then
  redis.call('EXPIRE', KEYS[1], ttl)
  redis.call('EXPIRE', KEYS[2], ttl)
end
return redis.call('LLEN', KEYS[2])
"""


def meta_key(request_id: str) -> str:
    return f"{{req:{request_id}}}:meta"


def tokens_key(request_id: str) -> str:
    return f"{{req:{request_id}}}:tokens"


class RedisStateStore:
    """`StateStore` over Redis (redis-py with hiredis). Counts its round trips."""

    def __init__(self, url: str, finished_ttl_s: int = 3600, timeout_s: float = 2.0):
        if finished_ttl_s < 1:
            raise StateStoreError(f"finished_ttl_s={finished_ttl_s} must be >= 1 second")
        self.url = url
        self.finished_ttl_s = finished_ttl_s
        self.round_trips = 0
        self.on_round_trip: Callable[[float], None] | None = None
        """Called with the seconds of every round trip (the redis_round_trip metric)."""
        # No hidden retries: a failed round trip surfaces at once and the caller re-sends.
        self._client = redis.Redis.from_url(
            url,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0),
        )
        self._script_sha: str | None = None

    def close(self) -> None:
        self._client.close()

    # -- writes ----------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        """Persist a new request: index entry first, so a half-done add leaves only an index
        entry without a request, which recovery drops."""
        pipe = self._pipeline_loading_script()
        pipe.zadd(INDEX_KEY, {request.request_id: request.arrival_time})
        pipe.delete(tokens_key(request.request_id))
        pipe.hset(meta_key(request.request_id), mapping=_encode_meta(request))
        if request.output_token_ids:
            pipe.rpush(tokens_key(request.request_id), *request.output_token_ids)
        self._execute_loading_script(pipe)

    def apply(self, updates: list[RequestUpdate]) -> None:
        """Persist one step's changes in one round trip (plus one to reload the Lua script
        if Redis lost it, e.g. after a restart)."""
        if not updates:
            return
        sha = self._script_sha or self._load_script()
        results = self._execute(self._apply_pipeline(sha, updates))
        if any(isinstance(r, NoScriptError) for r in results):
            results = self._execute(self._apply_pipeline(self._load_script(), updates))
        errors = [r for r in results if isinstance(r, Exception)]
        if errors:
            raise StateStoreError(f"Redis at {self.url} refused a state write: {errors[0]}")

    def _apply_pipeline(self, sha: str, updates: list[RequestUpdate]):
        pipe = self._client.pipeline(transaction=False)
        finished_ids = []
        for u in updates:
            state = u.status.value if u.status is not None else ""
            is_finished = u.status is not None and u.status.is_finished
            ttl = self.finished_ttl_s if is_finished else 0
            keys = (meta_key(u.request_id), tokens_key(u.request_id))
            pipe.evalsha(sha, 2, *keys, u.offset, state, u.reason or "", ttl, *u.token_ids)
            if is_finished:
                finished_ids.append(u.request_id)
        if finished_ids:
            pipe.zrem(INDEX_KEY, *finished_ids)
        return pipe

    # -- reads -----------------------------------------------------------------------------
    def load_unfinished(self) -> list[Request]:
        """Every unfinished request, WAITING with its prompt and outputs so far, oldest first."""
        pipe = self._pipeline_loading_script()
        pipe.zrange(INDEX_KEY, 0, -1)
        ids = [i.decode() for i in self._execute_loading_script(pipe)[-1]]
        pipe = self._client.pipeline(transaction=False)
        for request_id in ids:
            pipe.hgetall(meta_key(request_id))
            pipe.lrange(tokens_key(request_id), 0, -1)
        results = self._execute(pipe) if ids else []
        requests, stale = [], []
        for i, request_id in enumerate(ids):
            meta, tokens = results[2 * i], results[2 * i + 1]
            state = meta.get(b"state", b"").decode() if meta else ""
            if not meta or RequestStatus(state).is_finished:
                stale.append(request_id)
                continue
            requests.append(_decode_request(request_id, meta, [int(t) for t in tokens]))
        if stale:
            logger.info("dropping %d stale ids from the unfinished index", len(stale))
            self._execute_one(lambda c: c.zrem(INDEX_KEY, *stale))
        return requests

    def read_tokens(self, request_id: str, offset: int = 0) -> list[int]:
        """Output tokens of a request from `offset` on (a broken stream resumes here)."""
        tokens = self._execute_one(lambda c: c.lrange(tokens_key(request_id), offset, -1))
        return [int(t) for t in tokens]

    def read_owner_token(self, request_id: str) -> str | None:
        spec = self._execute_one(lambda c: c.hget(meta_key(request_id), "spec"))
        return json.loads(spec).get("owner_token", "") if spec else None

    def read_state(self, request_id: str) -> RequestStatus | None:
        state = self._execute_one(lambda c: c.hget(meta_key(request_id), "state"))
        return RequestStatus(state.decode()) if state else None

    # -- plumbing --------------------------------------------------------------------------
    def _pipeline_loading_script(self):
        # The Lua script rides along with the first write or read, so that every step
        # afterwards is exactly one round trip.
        pipe = self._client.pipeline(transaction=False)
        if self._script_sha is None:
            pipe.script_load(_APPEND_SCRIPT)
        return pipe

    def _execute_loading_script(self, pipe) -> list:
        had_script = self._script_sha is not None
        results = self._execute(pipe)
        errors = [r for r in results if isinstance(r, Exception)]
        if errors:
            raise StateStoreError(f"Redis at {self.url} refused a command: {errors[0]}")
        if not had_script:
            self._script_sha = results[0]
        return results

    def _load_script(self) -> str:
        self._script_sha = self._execute_one(lambda c: c.script_load(_APPEND_SCRIPT))
        return self._script_sha

    def _execute(self, pipe) -> list:
        return self._execute_one(lambda _client: pipe.execute(raise_on_error=False))

    def _execute_one(self, command):
        self.round_trips += 1
        observe = self.on_round_trip
        t0 = time.perf_counter() if observe is not None else 0.0
        try:
            return command(self._client)
        except RedisError as exc:
            raise self._error(exc) from exc
        finally:
            if observe is not None:
                observe(time.perf_counter() - t0)

    def _error(self, exc: Exception) -> StateStoreError:
        return StateStoreError(
            f"Redis at {self.url} did not answer ({type(exc).__name__}: {exc}); request state "
            "there is unchanged or partly written and the change will be sent again. Check "
            "that Redis is running and reachable (--redis-url)."
        )


def _encode_meta(request: Request) -> dict[str, bytes | str]:
    spec = {
        "sampling": asdict(request.sampling),
        "arrival_time": request.arrival_time,
        "priority": request.priority,
        "tenant": request.tenant,
        "weight": request.weight,
        "eos_token_id": request.eos_token_id,
        "extra_key": request.extra_key,
        "owner_token": request.owner_token,
    }
    return {
        "prompt": array("I", request.prompt_token_ids).tobytes(),
        "spec": json.dumps(spec),
        "state": request.status.value,
        "reason": request.fail_reason or "",
    }


def _decode_request(request_id: str, meta: dict[bytes, bytes], outputs: list[int]) -> Request:
    prompt = array("I")
    prompt.frombytes(meta[b"prompt"])
    spec = json.loads(meta[b"spec"])
    return Request(
        request_id=request_id,
        prompt_token_ids=prompt.tolist(),
        sampling=SamplingParams(**spec.pop("sampling")),
        output_token_ids=outputs,
        **spec,
    )

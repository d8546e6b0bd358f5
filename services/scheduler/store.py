"""Request state in Redis: the source of truth a restarted scheduler recovers from.

Keys (the `{req:<id>}` hash tag puts both keys of a request in one Redis Cluster slot)::

    {req:<id>}:meta     hash  prompt (packed uint32), spec (JSON: sampling params, tenant,
                              priority, weight, arrival, eos, extra key), state, reason,
                              owner (the pipeline that runs it: --pipeline-id, "" alone)
    {req:<id>}:tokens   list  output token ids, in order (the token log)
    conveyor:unfinished zset  ids of unfinished requests, scored by arrival (its own slot);
                              one per pipeline, `conveyor:unfinished:<pipeline id>`, when
                              several share one Redis (docs/scale-out.md)

One step = one round trip: `apply()` sends a non-transactional pipeline holding one EVALSHA
for every changed request of the step (append + state + TTL per request: one Lua call, not
one per request — 256 calls took ~11 ms a step, which limited the scheduler's plan rate)
and one ZREM of the finished ids. That script touches many requests' keys, so it needs a
single Redis (in a Cluster it would have to be split by slot). What holds:

* per request, the token log and state change together or not at all (one Lua script);
* appends are offset-checked: the script appends only the tokens past the log's length, so
  a replayed or re-sent step appends nothing twice, and a gap is refused, never written;
* a finished state is never overwritten; finished keys expire after `finished_ttl_s`;
* a request is written only by its owner: another pipeline that adopted it (see
  services/scheduler/registry.py) fences this one off, whose writes to it are refused
  (MOVED) and which then drops it (`take_moved()`);
* the index may briefly list a finished or vanished request (if a pipeline broke halfway):
  `load_unfinished()` checks each id's own state and drops stale entries.

Any Redis failure raises `StateStoreError`; the caller keeps its writes and sends them again.

While the scheduler lives, its memory is the source of truth and Redis its durable copy.
`apply()` notices when Redis lost what was written — a different server `run_id` (Redis
restarted, empty or from an older snapshot; checked at least every `check_interval_s` and
after every failed round trip), or a request's keys missing or shorter than its log — and
raises `StoreLost`; the caller then `rewrite()`s every live request from memory, and
requests the old snapshot still lists as unfinished but the scheduler no longer holds are
closed as aborted (they finished while Redis was down: never recomputed, never duplicated).
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
from redis.exceptions import AuthenticationError, NoScriptError, RedisError
from redis.retry import Retry

from services.common.errors import RequestExists, StateStoreError, StoreLost
from services.common.redis_url import redacted, refused_auth_message
from services.common.sampling import SamplingParams
from services.scheduler.request import Request, RequestStatus
from services.scheduler.state import RequestUpdate

logger = logging.getLogger(__name__)

INDEX_KEY = "conveyor:unfinished"
LOST_REASON = "Redis lost this request's state (restarted from an older snapshot)"

# One call persists a whole step. KEYS: meta and tokens key of each request, in pairs.
# ARGV[1]: JSON list, per request: [offset, state ('' = unchanged), reason, ttl (0 = none),
# [tokens...]] (one argument: redis-py encodes thousands of small ones slowly). ARGV[2]: the
# writer's pipeline id.
# Returns, per request: its log's length after the append, LOST (-1) when its meta is gone,
# GAP (-2) when its log is shorter than `offset`, MOVED (-3) when another pipeline owns it
# (none is written).
_APPLY_SCRIPT = """
local out = {}
local updates = cjson.decode(ARGV[1])
for i, u in ipairs(updates) do
  local meta, tokens = KEYS[2 * i - 1], KEYS[2 * i]
  local offset, state, reason, ttl, new = u[1], u[2], u[3], u[4], u[5]
  if redis.call('EXISTS', meta) == 0 then
    out[#out + 1] = -1
  elseif (redis.call('HGET', meta, 'owner') or '') ~= ARGV[2] then
    out[#out + 1] = -3
  else
    local len = redis.call('LLEN', tokens)
    if len < offset then
      out[#out + 1] = -2
    else
      local from, last = 1 + len - offset, #new
      for s = from, last, 1000 do
        redis.call('RPUSH', tokens, unpack(new, s, math.min(s + 999, last)))
      end
      if state ~= '' then
        local now = redis.call('HGET', meta, 'state') or ''
        if not (now == 'failed' or string.sub(now, 1, 8) == 'finished') then
          redis.call('HSET', meta, 'state', state, 'reason', reason)
        end
      end
      if ttl > 0 then
        redis.call('EXPIRE', meta, ttl)
        redis.call('EXPIRE', tokens, ttl)
      end
      out[#out + 1] = len + math.max(0, last - from + 1)
    end
  end
end
return out
"""
_LOST, _GAP, _MOVED = -1, -2, -3


def meta_key(request_id: str) -> str:
    return f"{{req:{request_id}}}:meta"


def tokens_key(request_id: str) -> str:
    return f"{{req:{request_id}}}:tokens"


def index_key(pipeline_id: str) -> str:
    """The unfinished index of one pipeline (the historical name for a lone one)."""
    return f"{INDEX_KEY}:{pipeline_id}" if pipeline_id else INDEX_KEY


class RedisStateStore:
    """`StateStore` over Redis (redis-py with hiredis). Counts its round trips."""

    def __init__(
        self,
        url: str,
        finished_ttl_s: int = 3600,
        timeout_s: float = 2.0,
        check_interval_s: float = 1.0,
        password: str | None = None,
        pipeline_id: str = "",
    ):
        """`password` (see services/common/redis_auth.py) is sent unless the URL holds one;
        `pipeline_id` names the pipeline whose requests this store writes and recovers."""
        if finished_ttl_s < 1:
            raise StateStoreError(f"finished_ttl_s={finished_ttl_s} must be >= 1 second")
        self.url = redacted(url)
        """The URL without its password: it goes into logs and error messages."""
        self.finished_ttl_s = finished_ttl_s
        self.pipeline_id = pipeline_id
        self.index_key = index_key(pipeline_id)
        self.round_trips = 0
        self._moved: set[str] = set()
        """Requests another pipeline adopted (their writes were refused), until taken."""
        self.on_round_trip: Callable[[float], None] | None = None
        """Called with the seconds of every round trip (the redis_round_trip metric)."""
        # No hidden retries: a failed round trip surfaces at once and the caller re-sends.
        self._client = redis.Redis.from_url(
            url,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0),
            password=password,
        )
        self._script_sha: str | None = None
        self._run_id: str | None = None
        """The Redis server instance our state was written to (INFO server run_id)."""
        self._check_interval_s = check_interval_s
        self._next_check = 0.0

    def close(self) -> None:
        self._client.close()

    # -- writes ----------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        """Persist a new request: index entry first, so a half-done add leaves only an index
        entry without a request, which recovery drops. Among several pipelines, an id
        another pipeline runs is refused (RequestExists), as a duplicate is on one."""
        if self.pipeline_id:
            self._check_id_free(request)
        pipe = self._pipeline_loading_script()
        pipe.zadd(self.index_key, {request.request_id: request.arrival_time})
        pipe.delete(tokens_key(request.request_id))
        pipe.hset(meta_key(request.request_id), mapping=_encode_meta(request, self.pipeline_id))
        if request.output_token_ids:
            pipe.rpush(tokens_key(request.request_id), *request.output_token_ids)
        self._execute_loading_script(pipe)

    def _check_id_free(self, request: Request) -> None:
        """Refuses an id running on another pipeline, and a submission that ran already
        (its owner token): a scheduler stopped with a Submit unread reads it on waking, after
        the router sent it again to another pipeline."""
        request_id = request.request_id
        state, owner, spec = self._execute_one(
            lambda c: c.hmget(meta_key(request_id), "state", "owner", "spec")
        )
        if state is None:
            return
        owner = (owner or b"").decode() or "(unnamed)"
        if RequestStatus(state.decode()).is_finished:
            token = request.owner_token
            if token and json.loads(spec).get("owner_token") == token:
                raise RequestExists(
                    f"request id {request_id} ran already (this submission, on pipeline "
                    f"{owner}): Resume it"
                )
            return
        if owner != self.pipeline_id:
            raise RequestExists(
                f"request id {request_id} is already in use on pipeline {owner}: pick a "
                "unique id, or Resume it"
            )

    def apply(self, updates: list[RequestUpdate]) -> set[str]:
        """Persist one step's changes in one round trip (plus one to reload the Lua script
        if Redis lost it, e.g. after a restart). Returns the requests another pipeline
        adopted (none of their writes was made), also kept for `take_moved()`."""
        if not updates:
            return set()
        sha = self._script_sha or self._load_script()
        check = time.monotonic() >= self._next_check
        results = self._execute(self._apply_pipeline(sha, updates, check))
        if any(isinstance(r, NoScriptError) for r in results):
            results = self._execute(self._apply_pipeline(self._load_script(), updates, check))
        if check:
            self._check_run_id(results.pop(0))
        errors = [r for r in results if isinstance(r, Exception)]
        if errors:
            raise StateStoreError(f"Redis at {self.url} refused a state write: {errors[0]}")
        lengths = results[0]
        moved = {u.request_id for u, n in zip(updates, lengths, strict=True) if n == _MOVED}
        self._moved.update(moved)
        lost = [u.request_id for u, n in zip(updates, lengths, strict=True) if n in (_LOST, _GAP)]
        if lost:
            raise StoreLost(
                f"Redis at {self.url} lost the state of {len(lost)} requests (e.g. {lost[0]})"
            )
        return moved

    def take_moved(self) -> set[str]:
        """The requests whose writes were refused since the last call: another pipeline
        adopted them (this one was NOT_SERVING too long), so this one must drop them."""
        moved, self._moved = self._moved, set()
        return moved

    def check(self) -> None:
        """Raises StateStoreError when Redis does not answer, StoreLost when it is not the
        instance our state was written to (it restarted): one round trip."""
        self._check_run_id(self._execute_one(lambda c: c.info("server")))

    def rewrite(self, requests: list[Request]) -> None:
        """Writes these requests whole (state, prompt, params, every output token), after
        Redis lost state; unfinished requests the index lists but `requests` lacks are closed
        as aborted. Leaves the store in step with the caller's memory."""
        sha = self._load_script()  # a restarted Redis has lost its scripts
        pipe = self._client.pipeline(transaction=False)
        pipe.info("server")
        pipe.zrange(self.index_key, 0, -1)
        info, listed = self._execute_checked(pipe)
        ids = {r.request_id for r in requests}
        pipe = self._client.pipeline(transaction=False)
        for request in requests:
            self._write_whole(pipe, request)
        stale = [i.decode() for i in listed if i.decode() not in ids]
        if stale:  # the script leaves a vanished request alone
            aborted = RequestStatus.FINISHED_ABORTED.value
            keys = [k for i in stale for k in (meta_key(i), tokens_key(i))]
            args = [(0, aborted, LOST_REASON, self.finished_ttl_s, [])] * len(stale)
            pipe.evalsha(sha, len(keys), *keys, json.dumps(args), self.pipeline_id)
            pipe.zrem(self.index_key, *stale)
        self._execute_checked(pipe)
        self._run_id = info.get("run_id")
        logger.warning(
            "rewrote %d requests to Redis at %s; closed %d it listed as unfinished",
            len(requests),
            self.url,
            len(stale),
        )

    def _write_whole(self, pipe, request: Request) -> None:
        request_id = request.request_id
        pipe.delete(tokens_key(request_id))
        pipe.hset(meta_key(request_id), mapping=_encode_meta(request, self.pipeline_id))
        if request.output_token_ids:
            pipe.rpush(tokens_key(request_id), *request.output_token_ids)
        if request.status.is_finished:
            pipe.expire(meta_key(request_id), self.finished_ttl_s)
            pipe.expire(tokens_key(request_id), self.finished_ttl_s)
            pipe.zrem(self.index_key, request_id)
        else:
            pipe.zadd(self.index_key, {request_id: request.arrival_time})

    def _check_run_id(self, info) -> None:
        self._next_check = time.monotonic() + self._check_interval_s
        if isinstance(info, Exception):
            raise StateStoreError(f"Redis at {self.url} refused INFO: {info}")
        run_id = info.get("run_id")
        if self._run_id is None:
            self._run_id = run_id
        elif run_id != self._run_id:
            raise StoreLost(f"Redis at {self.url} restarted (run_id {run_id})")

    def _apply_pipeline(self, sha: str, updates: list[RequestUpdate], check: bool):
        pipe = self._client.pipeline(transaction=False)
        if check:
            pipe.info("server")
        keys, args, finished_ids = [], [], []
        for u in updates:
            state = u.status.value if u.status is not None else ""
            is_finished = u.status is not None and u.status.is_finished
            ttl = self.finished_ttl_s if is_finished else 0
            keys += (meta_key(u.request_id), tokens_key(u.request_id))
            args.append((u.offset, state, u.reason or "", ttl, u.token_ids))
            if is_finished:
                finished_ids.append(u.request_id)
        pipe.evalsha(sha, len(keys), *keys, json.dumps(args), self.pipeline_id)
        if finished_ids:
            pipe.zrem(self.index_key, *finished_ids)
        return pipe

    # -- reads -----------------------------------------------------------------------------
    def load_unfinished(self) -> list[Request]:
        """Every unfinished request, WAITING with its prompt and outputs so far, oldest first."""
        pipe = self._pipeline_loading_script()
        pipe.info("server")
        pipe.zrange(self.index_key, 0, -1)
        *_, info, listed = self._execute_loading_script(pipe)
        self._run_id = info.get("run_id")
        return self.load_requests([i.decode() for i in listed])

    def load_requests(self, ids: list[str]) -> list[Request]:
        """These requests, WAITING with their prompt and outputs so far, in the given order;
        finished or vanished ones are dropped (and removed from this pipeline's index)."""
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
            self._execute_one(lambda c: c.zrem(self.index_key, *stale))
        return requests

    def read_tokens(self, request_id: str, offset: int = 0) -> list[int]:
        """Output tokens of a request from `offset` on (a broken stream resumes here)."""
        tokens = self._execute_one(lambda c: c.lrange(tokens_key(request_id), offset, -1))
        return [int(t) for t in tokens]

    def read_owner_token(self, request_id: str) -> str | None:
        spec = self._execute_one(lambda c: c.hget(meta_key(request_id), "spec"))
        return json.loads(spec).get("owner_token", "") if spec else None

    def read_prompt_len(self, request_id: str) -> int:
        size = self._execute_one(lambda c: c.hstrlen(meta_key(request_id), "prompt"))
        return int(size) // 4  # packed uint32

    def read_owner_pipeline(self, request_id: str) -> str | None:
        """The pipeline that owns a request ("" for a lone pipeline); None when unknown."""
        owner, spec = self._execute_one(lambda c: c.hmget(meta_key(request_id), "owner", "spec"))
        if spec is None:
            return None
        return owner.decode() if owner else ""

    def read_owners(self, request_ids: list[str]) -> dict[str, str | None]:
        """The owning pipeline of each request (None when unknown): one round trip."""
        pipe = self._client.pipeline(transaction=False)
        for request_id in request_ids:
            pipe.hget(meta_key(request_id), "owner")
        owners = self._execute_checked(pipe) if request_ids else []
        return {
            request_id: owner.decode() if owner is not None else None
            for request_id, owner in zip(request_ids, owners, strict=True)
        }

    def read_state(self, request_id: str) -> RequestStatus | None:
        state = self._execute_one(lambda c: c.hget(meta_key(request_id), "state"))
        return RequestStatus(state.decode()) if state else None

    # -- plumbing --------------------------------------------------------------------------
    def _pipeline_loading_script(self):
        # The Lua script rides along with the first write or read, so that every step
        # afterwards is exactly one round trip.
        pipe = self._client.pipeline(transaction=False)
        if self._script_sha is None:
            pipe.script_load(_APPLY_SCRIPT)
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
        self._script_sha = self._execute_one(lambda c: c.script_load(_APPLY_SCRIPT))
        return self._script_sha

    def _execute(self, pipe) -> list:
        return self._execute_one(lambda _client: pipe.execute(raise_on_error=False))

    def _execute_checked(self, pipe) -> list:
        results = self._execute(pipe)
        errors = [r for r in results if isinstance(r, Exception)]
        if errors:
            raise StateStoreError(f"Redis at {self.url} refused a command: {errors[0]}")
        return results

    def _execute_one(self, command):
        self.round_trips += 1
        observe = self.on_round_trip
        t0 = time.perf_counter() if observe is not None else 0.0
        try:
            return command(self._client)
        except RedisError as exc:
            self._next_check = 0.0  # Redis may have restarted: check its run_id next time
            raise self._error(exc) from exc
        finally:
            if observe is not None:
                observe(time.perf_counter() - t0)

    def _error(self, exc: Exception) -> StateStoreError:
        if isinstance(exc, AuthenticationError):
            return StateStoreError(refused_auth_message(self.url, exc))
        return StateStoreError(
            f"Redis at {self.url} did not answer ({type(exc).__name__}: {exc}); request state "
            "there is unchanged or partly written and the change will be sent again. Check "
            "that Redis is running and reachable (--redis-url)."
        )


def _encode_meta(request: Request, owner: str) -> dict[str, bytes | str]:
    spec = {
        "sampling": asdict(request.sampling),
        "arrival_time": request.arrival_time,
        "priority": request.priority,
        "tenant": request.tenant,
        "weight": request.weight,
        "eos_token_ids": list(request.eos_token_ids),
        "extra_key": request.extra_key,
        "owner_token": request.owner_token,
    }
    return {
        "prompt": array("I", request.prompt_token_ids).tobytes(),
        "spec": json.dumps(spec),
        "state": request.status.value,
        "reason": request.fail_reason or "",
        "owner": owner,
    }


def _decode_request(request_id: str, meta: dict[bytes, bytes], outputs: list[int]) -> Request:
    prompt = array("I")
    prompt.frombytes(meta[b"prompt"])
    spec = json.loads(meta[b"spec"])
    if "eos_token_id" in spec:  # written before requests kept every EOS id: one id or null
        legacy = spec.pop("eos_token_id")
        spec["eos_token_ids"] = [] if legacy is None else [legacy]
    spec["eos_token_ids"] = tuple(spec.get("eos_token_ids", ()))
    return Request(
        request_id=request_id,
        prompt_token_ids=prompt.tolist(),
        sampling=SamplingParams(**spec.pop("sampling")),
        output_token_ids=outputs,
        **spec,
    )

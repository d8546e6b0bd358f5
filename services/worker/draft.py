"""`Drafter`: the draft worker's core, greedy proposals of a small model for speculation.

The draft model is a whole model in one stage: a `StageRunner` (the stage workers' model,
paged KV cache and sampler) driven by plans this module writes itself, over its own
`BlockManager` (the scheduler's block pool, with prefix caching). Per request it keeps the
tokens whose KV it computed; each call sends only what is new (docs/speculative-decoding.md):

    held:     t0 … t9 d1 d2 d3            its KV: t0…t9 and its own earlier drafts d1 d2
    call:     start = 10, new = a1 a2 x   (the target accepted d1 d2 as a1 a2, then x)
    sequence: t0 … t9 a1 a2 x             compute from the first position that differs
                                          from what is held (here x: d1 d2 are kept)
    propose:  one prefill chunk of the new positions, then k - 1 one-token decode steps,
              the whole batch at once; the proposal is the k greedy tokens

A request it holds no state for (it restarted, evicted it for room, or had no room for its
new tokens in the last call) while `start` > 0 is answered as unknown: the scheduler sends
it again whole, and it is recomputed. The scheduler counts every request of an answered
call as holding what it sent, so one the worker did not compute must be forgotten here:
extending its old state would put the worker's own rejected drafts where the target's
tokens go.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass

from services.common.errors import InvalidRequest
from services.common.sampling import SamplingParams
from services.common.step import CachedRequest, NewRequest, StepPlan
from services.scheduler.block_manager import BlockManager
from services.scheduler.ownership import check_request_key
from services.worker.runner import MAX_SPEC_TOKENS, StageRunner

logger = logging.getLogger(__name__)

_GREEDY = SamplingParams(temperature=0.0, max_tokens=1 << 30)


@dataclass(slots=True)
class DraftSequence:
    """One request of a Propose call: its tokens since `start`, and k."""

    request_id: str
    start: int
    """Tokens sent in earlier calls that `token_ids` follow."""
    token_ids: list[int]
    num_tokens: int
    """Tokens to propose."""


@dataclass(slots=True)
class DraftOutput:
    """What one Propose call answers."""

    proposals: dict[str, list[int]]
    """Request id -> proposed tokens (requests without room get none)."""
    unknown_request_ids: list[str]
    """Requests to send again whole (start = 0)."""


class Drafter:
    """Holds the draft model's runner and KV pool; proposes tokens for batches of requests.
    Not thread-safe: one call at a time (the server serializes them)."""

    def __init__(self, runner: StageRunner, max_model_len: int, enable_prefix_caching: bool = True):
        if not (runner.stage.is_first and runner.stage.is_last):
            raise ValueError("the draft model runs as one stage holding every layer")
        self.runner = runner
        self.max_model_len = max_model_len
        kv = runner.kv_cache
        self.blocks = BlockManager(kv.num_blocks, kv.block_size, enable_prefix_caching)
        self._recent: OrderedDict[str, None] = OrderedDict()
        """Requests held, least recently proposed for first (evicted first for room)."""
        self._next_step_id = 0

    @property
    def vocab_size(self) -> int:
        return self.runner.model.config.vocab_size

    @property
    def num_requests(self) -> int:
        return len(self._recent)

    def free(self, request_id: str) -> None:
        """Forget a request (finished, aborted, or evicted for room)."""
        self.runner.requests.pop(request_id, None)
        self.blocks.free(request_id)
        self._recent.pop(request_id, None)

    def propose(self, sequences: list[DraftSequence], finished_ids: list[str]) -> DraftOutput:
        """Greedy proposals for `sequences` after freeing `finished_ids`. Raises
        InvalidRequest when a sequence is malformed (request ids, token ids, k, duplicates)."""
        for request_id in finished_ids:
            self.free(request_id)
        self._check(sequences)
        out = DraftOutput({}, [])
        plan = self._plan()
        wanted: dict[str, tuple[int, int]] = {}  # request id -> (sequence length, k)
        batch_ids = {seq.request_id for seq in sequences}
        for seq in sequences:
            state = self.runner.requests.get(seq.request_id)
            if seq.start and (state is None or len(state.token_ids) < seq.start):
                self.free(seq.request_id)
                out.unknown_request_ids.append(seq.request_id)
                continue
            tokens = (state.token_ids[: seq.start] if seq.start else []) + seq.token_ids
            num_tokens = min(seq.num_tokens, self.max_model_len - len(tokens))
            if (
                tokens
                and num_tokens > 0
                and self._schedule(plan, seq, tokens, num_tokens, batch_ids)
            ):
                wanted[seq.request_id] = (len(tokens), num_tokens)
            else:  # not computed: forget it, or its next call would extend stale tokens
                self.free(seq.request_id)
        if not wanted:
            return out
        self.runner.execute(plan)
        for request_id, (num_known, _) in wanted.items():
            self.blocks.cache_full_blocks(request_id, self._state(request_id).token_ids, num_known)
        # decode: the rest of the k tokens, one step each, for the requests that want more
        for i in range(1, max(k for _, k in wanted.values())):
            plan = self._plan()
            plan.cached_requests = [
                CachedRequest(request_id, 1) for request_id, (_, k) in wanted.items() if k > i
            ]
            self.runner.execute(plan)
        for request_id, (num_known, k) in wanted.items():
            out.proposals[request_id] = self._state(request_id).token_ids[num_known:][:k]
        return out

    def _check(self, sequences: list[DraftSequence]) -> None:
        seen = set()
        vocab_size = self.vocab_size
        for seq in sequences:
            check_request_key(seq.request_id)
            if seq.request_id in seen:
                raise InvalidRequest(f"request {seq.request_id!r} appears twice in one call")
            seen.add(seq.request_id)
            if not 1 <= seq.num_tokens <= MAX_SPEC_TOKENS:
                raise InvalidRequest(
                    f"request {seq.request_id!r}: num_tokens={seq.num_tokens} is out of range: "
                    f"must be in [1, {MAX_SPEC_TOKENS}]"
                )
            if any(not 0 <= t < vocab_size for t in seq.token_ids):
                raise InvalidRequest(
                    f"request {seq.request_id!r}: a token id is outside the draft model's "
                    f"vocabulary [0, {vocab_size})"
                )

    def _plan(self) -> StepPlan:
        self._next_step_id += 1
        return StepPlan(step_id=self._next_step_id)

    def _state(self, request_id: str):
        return self.runner.requests[request_id]

    def _schedule(
        self, plan: StepPlan, seq: DraftSequence, tokens: list[int], k: int, batch_ids: set[str]
    ) -> bool:
        """Adds the request's prefill chunk (the positions not held yet) to `plan`, with KV
        slots for its k - 1 drafts too; False when the pool has no room even after evicting
        requests outside this batch."""
        request_id = seq.request_id
        state = self.runner.requests.get(request_id)
        num_slots = len(tokens) + k - 1
        if state is None:
            prefix = self.blocks.find_cached_prefix(tokens)
            if not self._make_room(request_id, num_slots, batch_ids, prefix):
                return False
            block_ids = self.blocks.allocate(request_id, num_slots, prefix)
            num_cached = prefix.num_tokens(self.blocks.block_size)
            plan.new_requests.append(
                NewRequest(
                    request_id, tokens, len(tokens), _GREEDY, block_ids, num_cached,
                    len(tokens) - num_cached,
                )
            )  # fmt: skip
        else:
            # Reuse the longest held prefix (the first `start` tokens are the same by
            # definition), but compute the last token: its logits give the first draft.
            num_same = min(seq.start, state.num_computed_tokens, len(tokens) - 1)
            limit = min(state.num_computed_tokens, len(tokens) - 1)
            while num_same < limit and state.token_ids[num_same] == tokens[num_same]:
                num_same += 1
            if not self._make_room(request_id, num_slots, batch_ids):
                return False
            plan.cached_requests.append(
                CachedRequest(
                    request_id,
                    len(tokens) - num_same,
                    self.blocks.allocate(request_id, num_slots),
                    tokens[num_same:],
                    num_computed_tokens=num_same,
                )
            )
        self._recent[request_id] = None
        self._recent.move_to_end(request_id)
        return True

    def _make_room(self, request_id: str, num_slots: int, batch_ids: set[str], prefix=None) -> bool:
        """Evicts the least recently proposed requests outside this batch until the request
        fits (they are recomputed if they come back)."""
        while not self.blocks.can_allocate(request_id, num_slots, prefix):
            victim = next((r for r in self._recent if r not in batch_ids), None)
            if victim is None:
                logger.warning("draft KV cache full: no proposal for %s this call", request_id)
                return False
            self.free(victim)
        return True

"""Which pipeline a request goes to (pure): `--routing round-robin|least-load|prefix`.

Every pipeline is seen as a `PipelineView`: health, load (this router's open streams on it
and the queue its scheduler announced) and the KV blocks its prefix cache holds (the hashes
it announced, plus those this router sent it lately: announcements lag by up to a second).

prefix (the default) picks the pipeline of least cost, with `w` = `--routing-load-weight`::

    cost(p) = uncached_blocks(p) + w * load(p)
    uncached_blocks(p) = prompt blocks - longest run of the prompt's chain hashes, from the
                         first block on, that p holds (a chain hash names the whole prefix)
    load(p) = max(this router's open streams on p, p's announced running + waiting less this
                  router's streams on p that have ended since that announcement was written)

so a prompt whose prefix one pipeline holds goes there until that pipeline's extra load
costs more than recomputing the prefix elsewhere would: one hot prefix spills over instead of
piling onto one pipeline. The hashes are salted with the tenant (the prefix cache is shared
within a tenant only), so a tenant's requests stick to the pipelines that hold its prefixes.
Ties go round-robin, and a cost within one stream's load (`w`) of the least is a tie: the
router knows a load to one stream at best (an announcement lags, and counts streams of other
routers that may have ended since), and a stale stream on one pipeline must not send every
new prefix to the other for as long as the announcement stands (its prefix cache would
evict what it holds while the first one's sat unused).
"""

from __future__ import annotations

import enum
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from services.common.prefix_hash import prompt_block_hashes

LOCAL_TTL_S = 30.0
"""How long this router trusts its own record of a prefix it sent to a pipeline."""
LOCAL_MAX_ENTRIES = 50_000
"""(pipeline, block hash) pairs remembered: ~100 bytes each."""
ENDED_HORIZON_S = 60.0
"""How long this router remembers a stream that ended, for the load of a lagging announcement."""


class RoutingPolicy(str, enum.Enum):
    ROUND_ROBIN = "round-robin"
    LEAST_LOAD = "least-load"
    PREFIX = "prefix"


@dataclass(slots=True)
class PipelineView:
    """What the router knows of one pipeline."""

    key: str
    """The router's name for it (the scheduler's address)."""
    serving: bool = False
    num_inflight: int = 0
    """This router's open streams on it."""
    num_queued: int = 0
    """Running + waiting, as its scheduler last announced."""
    queued_at: float = 0.0
    """When that announcement was written, on this router's clock."""
    block_size: int = 0
    cache_epoch: int = 0
    prefix_hashes: frozenset[int] = field(default_factory=frozenset)
    ended: deque[tuple[float, float]] = field(default_factory=deque)
    """(opened, ended) of this router's streams on it that ended after `queued_at`."""
    num_ended_queued: int = 0
    """Of those, the ones opened before `queued_at`: counted in `num_queued`, gone since."""

    @property
    def load(self) -> int:
        """Streams it runs: the announced queue (which lags by up to a second or two) less
        this router's streams that have ended since, and never below this router's own."""
        return max(self.num_inflight, self.num_queued - self.num_ended_queued)

    def announced(self, num_queued: int, written_at: float) -> None:
        """Its scheduler's latest announcement, written at `written_at` (this router's clock)."""
        self.num_queued, self.queued_at = num_queued, written_at
        while self.ended and self.ended[0][1] <= written_at:
            self.ended.popleft()
        self.num_ended_queued = sum(1 for opened, _ in self.ended if opened <= written_at)

    def stream_ended(self, opened: float, now: float) -> None:
        """One of this router's streams on it, opened at `opened`, ended (or moved away).
        Remembered for ENDED_HORIZON_S at most: no announcement read is older (they expire
        after `--announce-ttl`), and a pipeline that announces nothing keeps no record."""
        self.num_inflight -= 1
        self.ended.append((opened, now))
        if opened <= self.queued_at:
            self.num_ended_queued += 1
        while self.ended[0][1] < now - ENDED_HORIZON_S:
            forgotten, _ = self.ended.popleft()
            if forgotten <= self.queued_at:
                self.num_ended_queued -= 1


class LocalPrefixIndex:
    """Chain hashes this router sent to each pipeline lately (bounded, LRU)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._entries: OrderedDict[tuple[str, int], float] = OrderedDict()

    def add(self, key: str, hashes: Sequence[int]) -> None:
        now = self._clock()
        for h in hashes:
            self._entries[(key, h)] = now
            self._entries.move_to_end((key, h))
        while len(self._entries) > LOCAL_MAX_ENTRIES:
            self._entries.popitem(last=False)

    def has(self, key: str, block_hash: int) -> bool:
        seen = self._entries.get((key, block_hash))
        return seen is not None and self._clock() - seen < LOCAL_TTL_S


class Router:
    """Chooses a pipeline for each request."""

    def __init__(self, policy: RoutingPolicy | str, load_weight: float = 0.5):
        self.policy = RoutingPolicy(policy)
        self.load_weight = load_weight
        self.local = LocalPrefixIndex()
        self._next = 0

    def choose(
        self, views: Sequence[PipelineView], prompt_ids: Sequence[int], extra_key: str
    ) -> PipelineView | None:
        """The pipeline for a prompt (`extra_key`: its tenant's cache salt), among the
        serving ones; None when none serves. Records the choice for prefix routing."""
        serving = [v for v in views if v.serving]
        if len(serving) <= 1:  # nothing to choose (a lone pipeline: no hashing at all)
            return serving[0] if serving else None
        start = self._next % len(serving)
        self._next += 1
        rotated = serving[start:] + serving[:start]  # ties: round-robin
        if self.policy is RoutingPolicy.ROUND_ROBIN:
            return rotated[0]
        if self.policy is RoutingPolicy.LEAST_LOAD:
            return min(rotated, key=lambda v: v.load)
        hashes_by_salt: dict[tuple[int, int], list[int]] = {}

        def hashes_for(view: PipelineView) -> list[int]:
            salt = (view.block_size, view.cache_epoch)
            if salt not in hashes_by_salt:
                hashes_by_salt[salt] = (
                    prompt_block_hashes(prompt_ids, view.block_size, extra_key, view.cache_epoch)
                    if view.block_size
                    else []
                )
            return hashes_by_salt[salt]

        def cost(view: PipelineView) -> float:
            hashes = hashes_for(view)
            return len(hashes) - self.matched_blocks(view, hashes) + self.load_weight * view.load

        costs = [cost(v) for v in rotated]
        within = min(costs) + self.load_weight  # one stream's load more still ties
        best = next(v for v, c in zip(rotated, costs, strict=True) if c <= within)
        self.local.add(best.key, hashes_for(best))
        return best

    def matched_blocks(self, view: PipelineView, hashes: Sequence[int]) -> int:
        """Leading blocks of the prompt that `view`'s cache holds (as far as is known)."""
        num = 0
        for h in hashes:
            if h not in view.prefix_hashes and not self.local.has(view.key, h):
                break
            num += 1
        return num

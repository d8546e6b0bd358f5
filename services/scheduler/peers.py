"""The scheduler's life among other pipelines: announce, adopt, let go (docs/scale-out.md).

Every third of `announce_ttl_s` (and at once after a refused write) the task below
  1. announces this pipeline (health, queue, KV usage, the prefix blocks it caches);
  2. lets go of requests another pipeline adopted meanwhile (the store refused their writes,
     or, while this pipeline is NOT_SERVING and steps nothing, their `owner` says so): their
     streams end naming the new owner, where the routers resume them;
  3. while SERVING, adopts the unfinished requests of every pipeline that is lost (its
     announcement expired, or NOT_SERVING past `adopt_grace_s`): ownership moves in one Lua
     call (services/scheduler/registry.py), then the requests are read and queued here to be
     recomputed; the routers' resumes find them here.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from services.common.errors import StateStoreError
from services.common.pipelines import Announcement
from services.scheduler.registry import PipelineRegistry
from services.scheduler.service import SchedulerService

logger = logging.getLogger(__name__)


def announcement_of(service: SchedulerService, address: str, max_blocks: int) -> Announcement:
    """What `service` says about its pipeline now."""
    ann = Announcement(service.config.pipeline_id, address, serving=service.serving)
    core = service.scheduler
    if core is None:
        return ann
    blocks = core.block_manager
    ann.num_waiting = core.num_waiting
    ann.num_running = len(core.running)
    ann.kv_usage = 1.0 - blocks.num_free_blocks / blocks.num_blocks
    ann.block_size = blocks.block_size
    ann.cache_epoch = blocks.cache_epoch
    ann.num_prefix_queried_tokens = blocks.num_queried_tokens
    ann.num_prefix_hit_tokens = blocks.num_hit_tokens
    ann.prefix_hashes = frozenset(blocks.recent_block_hashes(max_blocks))
    return ann


class PipelinePeers:
    """Announces `service`'s pipeline and adopts lost pipelines' requests."""

    def __init__(self, service: SchedulerService, registry: PipelineRegistry, address: str):
        self.service = service
        self.registry = registry
        self.address = address
        self.num_adopted = 0
        self._unloaded: list[str] = []
        """Adopted ids (ours in Redis) not read back yet: a failed read is retried."""

    async def run(self) -> None:
        config = self.service.config
        interval_s = config.announce_ttl_s / 3
        refused = self.service.writes_refused
        while True:
            try:
                await self.tick()
            except StateStoreError as exc:
                logger.warning("pipeline %s: %s", config.pipeline_id, exc)
            # The next tick, or at once when a write was refused: another pipeline adopted
            # what this one holds (it was judged lost while stalled), and every step until
            # it lets go is work thrown away.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(refused.wait(), interval_s)
            refused.clear()

    async def tick(self) -> None:
        config = self.service.config
        ann = announcement_of(self.service, self.address, config.announce_max_blocks)
        await asyncio.to_thread(self.registry.announce, ann, config.announce_ttl_s)
        await self._let_go()
        if not self.service.serving or self.service.scheduler is None:
            return
        grace_s = config.adopt_grace_s
        for lost in await asyncio.to_thread(self.registry.lost_pipelines, grace_s):
            ids = await asyncio.to_thread(self.registry.adopt, lost, grace_s)
            if ids:
                logger.warning(
                    "pipeline %s is lost: adopting its %d unfinished requests", lost, len(ids)
                )
                self._unloaded += ids
        if self._unloaded:
            store = self.service.store
            requests = await asyncio.to_thread(store.load_requests, self._unloaded)
            self._unloaded = []
            self.service.adopt(requests)
            self.num_adopted += len(requests)

    async def _let_go(self) -> None:
        store, core = self.service.store, self.service.scheduler
        moved = store.take_moved()
        if core is not None and (moved or not self.service.serving):
            # An adoption takes every unfinished request of a pipeline at once, so one
            # refused write means the rest may be gone too, written or not (a waiting one
            # writes nothing); while NOT_SERVING nothing is stepped and nothing is refused.
            # Either way, ask Redis who owns what we hold.
            moved.update(core.requests)
        if not moved:
            return
        owners = await asyncio.to_thread(store.read_owners, sorted(moved))
        mine = self.service.config.pipeline_id
        elsewhere = {i: o for i, o in owners.items() if o is not None and o != mine}
        if elsewhere:
            self.service.release(elsewhere)

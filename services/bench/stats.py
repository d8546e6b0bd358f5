"""The scheduler's side of a benchmark run, read over its GetStats RPC.

`start()` resets the workers' step timelines (a new measurement window) and snapshots the
counters; `finish()` reads the bubble per stage over the window and the counters' change.
"""

from __future__ import annotations

import logging
import time

from services.common.security import ClientSecurity

logger = logging.getLogger(__name__)


class SchedulerProbe:
    """Bubble per stage, prefix-cache hit rate and preemptions over one run."""

    def __init__(self, address: str, security: ClientSecurity | None = None):
        self.address = address
        self.security = security or ClientSecurity()
        """TLS to the scheduler and the internal token (GetStats is for operators)."""
        self._start = None
        self._started_at = time.monotonic()

    async def _stats(self, reset: bool):
        from services.common.proto.conveyor.v1 import scheduler_pb2, scheduler_pb2_grpc

        async with self.security.channel(self.address) as channel:
            stub = scheduler_pb2_grpc.SchedulerStub(channel)
            request = scheduler_pb2.GetStatsRequest(reset_timelines=reset)
            metadata = self.security.with_metadata(None)
            return await stub.GetStats(request, timeout=30, metadata=metadata)

    async def start(self) -> None:
        self._start = await self._stats(reset=True)
        self._started_at = time.monotonic()

    async def finish(self) -> dict:
        """bubble_fraction (per stage, over the window), prefix_cache_hit_rate (since the
        scheduler started), preemptions (during the window), scheduling, num_stages, and
        over the window: plans_per_s and the scheduler's CPU seconds (in all and per plan)."""
        end = await self._stats(reset=False)
        start_preempted = self._start.num_preempted_total if self._start else 0
        start_steps = self._start.num_steps if self._start else 0
        num_plans = end.num_steps - start_steps
        cpu_s = end.cpu_seconds - (self._start.cpu_seconds if self._start else 0.0)
        spec = {}
        if end.speculative_config:  # over the window: the counters' change
            start = self._start or type(end)()
            num_steps = end.num_spec_steps - start.num_spec_steps
            num_drafts = end.num_spec_draft_tokens - start.num_spec_draft_tokens
            num_accepted = end.num_spec_accepted_tokens - start.num_spec_accepted_tokens
            spec = {
                "spec_steps": num_steps,
                "spec_acceptance_rate": num_accepted / num_drafts if num_drafts else 0.0,
                "spec_mean_accepted_length": (num_accepted + num_steps) / num_steps
                if num_steps
                else 0.0,
            }
        return spec | {
            "bubble_fraction": [round(b, 4) for b in end.bubble_fraction],
            "prefix_cache_hit_rate": end.prefix_cache_hit_rate,
            "preemptions": end.num_preempted_total - start_preempted,
            "scheduling": end.scheduling,
            "num_stages": end.num_stages,
            "mean_schedule_us": end.mean_schedule_us,
            "plans_per_s": num_plans / (time.monotonic() - self._started_at),
            "scheduler_cpu_s": cpu_s,
            "scheduler_cpu_per_plan_us": 1e6 * cpu_s / max(num_plans, 1),
        }

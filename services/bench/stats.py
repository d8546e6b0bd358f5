"""The scheduler's side of a benchmark run, read over its GetStats RPC.

`start()` resets the workers' step timelines (a new measurement window) and snapshots the
counters; `finish()` reads the bubble per stage over the window and the counters' change.
`SchedulerGate` holds a burst in the scheduler's queue and releases it whole
(`conveyor bench --release-at-once`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from services.common.errors import ConfigError
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
        """bubble_fraction and plan_wait_fraction (per stage, over the window: idle, and of
        that waiting for plans), prefix_cache_hit_rate (since the
        scheduler started), preemptions (during the window), scheduling, num_stages, the
        window at the end (max_inflight) and over the window: how often the async lead
        changed, plans_per_s and the scheduler's CPU seconds (in all and per plan)."""
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
            "plan_wait_fraction": [round(w, 4) for w in end.plan_wait_fraction],
            "prefix_cache_hit_rate": end.prefix_cache_hit_rate,
            "preemptions": end.num_preempted_total - start_preempted,
            "scheduling": end.scheduling,
            "num_stages": end.num_stages,
            "mean_schedule_us": end.mean_schedule_us,
            "max_inflight": end.max_inflight,
            "async_lead_changes": end.async_lead_changes
            - (self._start.async_lead_changes if self._start else 0),
            "plans_per_s": num_plans / (time.monotonic() - self._started_at),
            "scheduler_cpu_s": cpu_s,
            "scheduler_cpu_per_plan_us": 1e6 * cpu_s / max(num_plans, 1),
        }


class SchedulerGate:
    """Holds a burst in the scheduler's queue and releases it at once (`conveyor bench
    --release-at-once`): Pause (WAIT) before the first send, wait until every request is
    queued, Unpause. Every run then starts from the same state, the whole burst waiting,
    however fast the client could send it (on a small machine the client's sends compete
    with the stack they measure). Needs the scheduler's admin access (its internal token,
    or loopback when it has none) and one pipeline: the scheduler must see every request."""

    POLL_S = 0.02

    def __init__(
        self,
        address: str,
        security: ClientSecurity | None = None,
        timeout_s: float = 120.0,
        before_release: Callable[[], Awaitable[None]] | None = None,
    ):
        self.address = address
        self.security = security or ClientSecurity()
        self.timeout_s = timeout_s
        """How long the requests may take to reach the scheduler's queue."""
        self.before_release = before_release
        """Run once every request is queued, just before the release (a probe's start)."""
        self.is_held = False
        self.released_at: float | None = None
        """`time.perf_counter()` as the Unpause went out: where the run's times count from."""

    async def _call(self, method: str, request):
        import grpc

        from services.common.proto.conveyor.v1 import scheduler_pb2_grpc

        async with self.security.channel(self.address) as channel:
            stub = scheduler_pb2_grpc.SchedulerStub(channel)
            metadata = self.security.with_metadata(None)
            try:
                return await getattr(stub, method)(request, timeout=30, metadata=metadata)
            except grpc.aio.AioRpcError as exc:
                raise ConfigError(
                    f"the scheduler at {self.address} refused {method} "
                    f"({exc.code().name}: {exc.details()}): --release-at-once pauses it, which "
                    "takes its internal token (--internal-token-file) unless it has none and "
                    "the benchmark runs on its machine"
                ) from exc

    async def hold(self) -> None:
        """Pauses admission. Refuses a scheduler that is paused already (an operator's
        pause is theirs to end) or that has requests queued (they would join the burst)."""
        from services.common.proto.conveyor.v1 import scheduler_pb2

        stats = await self._call("GetStats", scheduler_pb2.GetStatsRequest())
        if stats.paused:
            raise ConfigError(
                f"the scheduler at {self.address} is paused already: --release-at-once "
                "pauses and unpauses it itself; Unpause it first"
            )
        if stats.num_waiting:
            raise ConfigError(
                f"the scheduler at {self.address} has {stats.num_waiting} requests queued: "
                "--release-at-once needs an empty queue to hold the burst in"
            )
        await self._call("Pause", scheduler_pb2.PauseRequest(mode=scheduler_pb2.PAUSE_MODE_WAIT))
        self.is_held = True

    async def wait_queued(self, num_requests: int, num_ended: Callable[[], int]) -> None:
        """Returns once `num_requests` requests wait in the scheduler's queue or have ended
        (`num_ended()`: refused by the router, say; they count as failed)."""
        from services.common.proto.conveyor.v1 import scheduler_pb2, scheduler_pb2_grpc

        start = time.monotonic()
        num_waiting = 0
        async with self.security.channel(self.address) as channel:
            stub = scheduler_pb2_grpc.SchedulerStub(channel)
            metadata = self.security.with_metadata(None)
            while time.monotonic() - start < self.timeout_s:
                stats = await stub.GetStats(
                    scheduler_pb2.GetStatsRequest(), timeout=30, metadata=metadata
                )
                num_waiting = stats.num_waiting
                if num_waiting + num_ended() >= num_requests:
                    return
                await asyncio.sleep(self.POLL_S)
        raise ConfigError(
            f"only {num_waiting} of {num_requests} requests reached the queue of the scheduler "
            f"at {self.address} in {time.monotonic() - start:.0f} s: --release-at-once needs "
            "every request to go to that scheduler (one pipeline behind the router)"
        )

    async def release(self) -> None:
        """Unpauses, if held (safe to call again)."""
        from services.common.proto.conveyor.v1 import scheduler_pb2

        if not self.is_held:
            return
        try:
            if self.before_release is not None:
                await self.before_release()
        finally:
            self.released_at = time.perf_counter()
            await self._call("Unpause", scheduler_pb2.UnpauseRequest())
            self.is_held = False

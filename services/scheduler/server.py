"""`conveyor scheduler`: the Scheduler gRPC service (thin edge over SchedulerService)."""

from __future__ import annotations

import asyncio
import logging
import os
import time

import grpc

from services.common.auth import Authenticator, OpenAccess
from services.common.errors import InvalidRequest
from services.common.pb import sampling_from_pb
from services.common.proto.conveyor.v1 import scheduler_pb2, scheduler_pb2_grpc
from services.common.security import require_admin
from services.common.serving import GrpcServer
from services.scheduler.config import SchedulerConfig
from services.scheduler.ownership import request_key
from services.scheduler.pipeline import Pipeline
from services.scheduler.scheduler import PauseMode
from services.scheduler.service import SchedulerService
from services.scheduler.session import RouterSession, delta_to_pb
from services.scheduler.timeline import write_chrome_trace
from services.scheduler.weights import WeightControl

logger = logging.getLogger(__name__)

SERVICE_NAME = scheduler_pb2.DESCRIPTOR.services_by_name["Scheduler"].full_name
STATS_TIMELINE_TIMEOUT_S = 2.0
"""GetStats waits this long for a stage's timeline (its bubble), then reports without it."""


PAUSE_MODES = {
    scheduler_pb2.PAUSE_MODE_UNSPECIFIED: PauseMode.WAIT,
    scheduler_pb2.PAUSE_MODE_WAIT: PauseMode.WAIT,
    scheduler_pb2.PAUSE_MODE_KEEP: PauseMode.KEEP,
    scheduler_pb2.PAUSE_MODE_ABORT: PauseMode.ABORT,
}
PAUSE_MODES_TO_PB = {None: scheduler_pb2.PAUSE_MODE_UNSPECIFIED} | {
    mode: code for code, mode in PAUSE_MODES.items() if code
}


class SchedulerServicer(scheduler_pb2_grpc.SchedulerServicer):
    def __init__(self, service: SchedulerService, authenticator: Authenticator | None = None):
        self.service = service
        self.authenticator = authenticator or OpenAccess()
        """Who gets in (the interceptor checks it); admin calls also ask `require_admin`."""
        self.weights = WeightControl(service)

    async def Submit(self, request, context):
        sampling = sampling_from_pb(request.sampling)
        traceparent = None
        if self.service.observer is not None:
            traceparent = dict(context.invocation_metadata() or ()).get("traceparent")
        key = request_key(request.principal, request.request_id)
        queue = self.service.submit(
            key,
            list(request.prompt_token_ids),
            sampling,
            priority=request.priority,
            tenant=request.tenant,
            weight=request.weight,
            traceparent=traceparent,
            owner_token=request.owner_token,
        )
        try:
            first = True
            while True:
                delta = await queue.get()
                msg = delta_to_pb(delta)
                if first:
                    msg.num_prompt_tokens = len(request.prompt_token_ids)
                    first = False
                yield msg
                if delta.finish_reason is not None or delta.owner_pipeline_id is not None:
                    return
        finally:
            self.service.unsubscribe(key, queue)

    async def Abort(self, request, context):
        key = request_key(request.principal, request.request_id)
        return scheduler_pb2.AbortResponse(aborted=self.service.abort(key, request.owner_token))

    async def Resume(self, request, context):
        key = request_key(request.principal, request.request_id)
        owner_token = None if request.any_submission else request.owner_token
        async for delta in self.service.resume(key, request.from_offset, owner_token):
            yield delta_to_pb(delta)

    async def Session(self, request_iterator, context):
        session = RouterSession(self.service, traceparents=self.service.observer is not None)
        async for response in session.run(request_iterator):
            yield response

    async def GetStats(self, request, context):
        return await stats_to_pb(self.service, reset_timelines=request.reset_timelines)

    # -- admin: pause, weights (docs/training.md) ------------------------------------------
    async def Pause(self, request, context):
        require_admin(context, self.authenticator)
        mode = PAUSE_MODES.get(request.mode)
        if mode is None:
            raise InvalidRequest(f"mode={request.mode} is not a PauseMode (wait, keep, abort)")
        num_aborted = await self.service.pause(mode)
        return self._pause_state(num_aborted)

    async def Unpause(self, request, context):
        require_admin(context, self.authenticator)
        self.service.unpause()
        return self._pause_state()

    def _pause_state(self, num_aborted: int = 0) -> scheduler_pb2.PauseState:
        service, core = self.service, self.service.scheduler
        return scheduler_pb2.PauseState(
            paused=service.pause_mode is not None,
            mode=PAUSE_MODES_TO_PB[service.pause_mode],
            num_running=len(core.running) if core else 0,
            num_waiting=core.num_waiting if core else 0,
            num_aborted=num_aborted,
            weight_version=service.weight_version,
        )

    async def UpdateWeights(self, request, context):
        require_admin(context, self.authenticator)
        progress = scheduler_pb2.UpdateWeightsProgress
        updates = self.weights.update(
            request.path, list(request.layers), request.recompute_kept, request.weight_version
        )
        async for update in updates:
            yield progress(
                phase=progress.PHASE_DONE if update.is_done else progress.PHASE_RECEIVING,
                weight_version=update.weight_version,
                num_tensors=update.num_tensors,
                pause_s=update.pause_s,
                stage_s=update.stage_s,
                commit_s=update.commit_s,
                total_s=update.total_s,
            )

    async def InitWeightTransfer(self, request, context):
        require_admin(context, self.authenticator)
        world_size = await self.weights.init_transfer(
            request.master_addr, request.master_port, request.timeout_s
        )
        return scheduler_pb2.InitWeightTransferResponse(world_size=world_size)


async def stats_to_pb(
    service: SchedulerService, reset_timelines: bool = False
) -> scheduler_pb2.SchedulerStats:
    msg = scheduler_pb2.SchedulerStats(
        num_stages=service.pipeline.num_stages,
        serving=service.serving,
        scheduling=service.config.scheduling.value,
        num_steps=service.counters.num_steps,
        not_serving_reason=service.not_serving_reason or "",
        cpu_seconds=time.process_time(),
        paused=service.pause_mode is not None,
        pause_mode=PAUSE_MODES_TO_PB[service.pause_mode],
        weight_version=service.weight_version,
        num_weight_updates=service.num_weight_updates,
        pipeline_id=service.config.pipeline_id,
    )
    core = service.scheduler
    if core is None:
        return msg
    blocks = core.block_manager.stats()
    msg.num_waiting = core.num_waiting
    msg.num_running = len(core.running)
    msg.num_preempted_total = core.num_preemptions
    msg.num_blocks, msg.num_free_blocks = blocks.num_blocks, blocks.num_free_blocks
    msg.num_cached_blocks, msg.kv_usage = blocks.num_cached_blocks, blocks.usage
    msg.fragmentation, msg.prefix_cache_hit_rate = blocks.fragmentation, blocks.prefix_hit_rate
    msg.block_size = core.config.block_size
    msg.num_prefix_queried_tokens = core.block_manager.num_queried_tokens
    msg.num_prefix_hit_tokens = core.block_manager.num_hit_tokens
    msg.num_inflight = service.inflight
    msg.max_inflight = service.max_inflight
    if service.lead is not None:
        msg.async_lead, msg.async_lead_changes = service.lead.lead, service.lead.num_changes
    if core.config.speculative is not None:
        spec = core.spec_stats
        msg.speculative_config = core.config.speculative.to_json()
        msg.num_spec_steps = spec.num_steps
        msg.num_spec_draft_tokens = spec.num_draft_tokens
        msg.num_spec_accepted_tokens = spec.num_accepted_tokens
        msg.spec_acceptance_rate = spec.acceptance_rate
        msg.spec_mean_accepted_length = spec.mean_accepted_length
    if service.drafts is not None:
        msg.num_draft_calls = service.drafts.counters.num_calls
        msg.num_draft_failures = service.drafts.counters.num_failures
        msg.draft_problem = service.drafts.problem or ""
    if service.counters.num_steps:
        msg.mean_schedule_us = 1e6 * service.counters.schedule_s / service.counters.num_steps
    for request_id in core.running:
        msg.request_blocks[request_id] = len(core.block_manager.block_table(request_id))
    try:
        # A stage that is gone or hung leaves the bubbles out, not the stats: they are what
        # an operator reads to find it.
        timelines = await service.pipeline.timelines(
            reset=reset_timelines, timeout_s=STATS_TIMELINE_TIMEOUT_S
        )
        msg.bubble_fraction.extend(t.bubble_fraction for t in timelines)
        msg.plan_wait_fraction.extend(t.plan_wait_fraction for t in timelines)
    except grpc.RpcError:
        pass
    return msg


async def write_timeline(pipeline: Pipeline, path: str) -> None:
    """Writes the stages' Chrome/Perfetto trace to `path` (`--timeline`, on stop): every stage
    that answers; a stage that is gone is named in a warning and left out, not the whole trace."""
    replies = await pipeline.timelines(include_steps=True, return_exceptions=True)
    timelines = []
    for stage, reply in enumerate(replies):
        if isinstance(reply, grpc.RpcError):
            logger.warning("stage %d's timeline is not in the trace: %s", stage, reply.code().name)
        elif isinstance(reply, BaseException):
            raise reply
        else:
            timelines.append(reply)
    write_chrome_trace(timelines, path)
    logger.info("wrote the pipeline timeline of %d stages to %s", len(timelines), path)


async def serve(config: SchedulerConfig) -> int:
    """Runs the scheduler until SIGTERM/SIGINT, then writes the timeline and stops; returns
    the exit code: 1 when the scheduling loop died (a supervisor restarts the process, which
    recovers every request from Redis), else 0."""
    from services.common.redis_auth import redis_connection_kwargs
    from services.common.redis_server import RedisServer
    from services.common.security import internal_client, internal_server_security
    from services.scheduler.observability import install as install_observers
    from services.scheduler.store import RedisStateStore

    redis_server = None
    redis_url = config.redis_url
    if not redis_url:
        redis_server = RedisServer().start()
        redis_url = redis_server.url
        logger.warning("no --redis-url: using a private redis-server; state will not survive it")
    redis_kwargs = redis_connection_kwargs(os.environ)
    store = RedisStateStore(
        redis_url,
        finished_ttl_s=config.finished_ttl_s,
        pipeline_id=config.pipeline_id,
        **redis_kwargs,
    )
    security = internal_server_security(
        config.tls_cert, config.tls_key, config.tls_ca, config.internal_token
    )
    to_workers = internal_client(
        config.tls_ca, config.tls_cert, config.tls_key, config.internal_token
    )
    pipeline = Pipeline(config.workers, to_workers)
    service = SchedulerService(config, pipeline, store)
    close_observers = install_observers(
        service, store, config.metrics_port, config.otlp_endpoint, config.trace_scheduler
    )
    server = GrpcServer(
        "scheduler",
        config.host,
        config.port,
        [SERVICE_NAME],
        options=[("grpc.max_receive_message_length", config.max_message_bytes)],
        security=security,
        health_port=config.health_port,
    )
    servicer = SchedulerServicer(service, security.authenticator)
    server.add(scheduler_pb2_grpc.add_SchedulerServicer_to_server, servicer)
    await server.start()
    service.on_serving_change(lambda serving: asyncio.ensure_future(server.set_serving(serving)))
    logger.info("scheduler on port %d waiting for %d stages", config.port, len(config.workers))
    peers_task, registry = None, None
    if config.pipeline_id:
        from services.scheduler.peers import PipelinePeers
        from services.scheduler.registry import PipelineRegistry

        registry = PipelineRegistry(redis_url, config.pipeline_id, **redis_kwargs)
        address = config.advertise_address or f"127.0.0.1:{config.port}"
        peers = PipelinePeers(service, registry, address)
        peers_task = asyncio.create_task(peers.run(), name="pipeline-peers")
        logger.info("pipeline %s announced at %s", config.pipeline_id, address)
    starter = asyncio.create_task(service.start())
    stopper = asyncio.create_task(server.wait_for_stop())
    await asyncio.wait({starter, stopper}, return_when=asyncio.FIRST_COMPLETED)
    if starter.done() and starter.exception():
        raise starter.exception()
    exit_code = 0
    if not stopper.done():
        dead = asyncio.create_task(service.loop_done())
        await asyncio.wait({stopper, dead}, return_when=asyncio.FIRST_COMPLETED)
        if dead.done():
            logger.critical("the scheduling loop died: %r; exiting", dead.result())
            await server.set_serving(False)
            exit_code = 1
        else:
            dead.cancel()
    await server.health.enter_graceful_shutdown()
    if config.timeline and service.scheduler is not None:
        await write_timeline(pipeline, config.timeline)
    starter.cancel()
    if peers_task is not None:
        peers_task.cancel()
        await asyncio.gather(peers_task, return_exceptions=True)
        registry.close()
    await server.stop(grace_s=3)
    await service.stop()
    close_observers()
    store.close()
    if redis_server:
        redis_server.stop()
    return exit_code

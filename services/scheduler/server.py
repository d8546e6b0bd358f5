"""`conveyor scheduler`: the Scheduler gRPC service (thin edge over SchedulerService)."""

from __future__ import annotations

import asyncio
import logging
import os
import signal

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from services.common.errors import ConveyorError, UnknownRequest
from services.common.grpc_errors import abort_with
from services.common.pb import FINISH_TO_PB, logprobs_to_pb, sampling_from_pb
from services.common.proto.conveyor.v1 import scheduler_pb2, scheduler_pb2_grpc
from services.scheduler.pipeline import Pipeline
from services.scheduler.service import SchedulerService, ServiceOptions
from services.scheduler.state import TokenDelta

logger = logging.getLogger(__name__)

SERVICE_NAME = scheduler_pb2.DESCRIPTOR.services_by_name["Scheduler"].full_name
_FINISHED_STATES = {
    "finished_stopped": "stop",
    "finished_length": "length",
    "finished_aborted": "abort",
    "failed": "error",
}


def delta_to_pb(delta: TokenDelta) -> scheduler_pb2.TokenDelta:
    msg = scheduler_pb2.TokenDelta(
        request_id=delta.request_id,
        offset=delta.offset,
        token_ids=delta.token_ids,
        finish_reason=FINISH_TO_PB[delta.finish_reason],
    )
    if delta.logprobs:
        msg.logprobs.extend(logprobs_to_pb(lp) for lp in delta.logprobs if lp is not None)
    return msg


class SchedulerServicer(scheduler_pb2_grpc.SchedulerServicer):
    def __init__(self, service: SchedulerService):
        self.service = service

    async def Submit(self, request, context):
        try:
            sampling = sampling_from_pb(request.sampling)
            traceparent = None
            if self.service.observer is not None:
                traceparent = dict(context.invocation_metadata() or ()).get("traceparent")
            queue = self.service.submit(
                request.request_id,
                list(request.prompt_token_ids),
                sampling,
                priority=request.priority,
                tenant=request.tenant,
                weight=request.weight,
                traceparent=traceparent,
            )
        except ConveyorError as exc:
            await abort_with(context, exc)
        try:
            first = True
            while True:
                delta = await queue.get()
                msg = delta_to_pb(delta)
                if first:
                    msg.num_prompt_tokens = len(request.prompt_token_ids)
                    first = False
                yield msg
                if delta.finish_reason is not None:
                    return
        finally:
            self.service.unsubscribe(request.request_id, queue)

    async def Abort(self, request, context):
        return scheduler_pb2.AbortResponse(aborted=self.service.abort(request.request_id))

    async def Resume(self, request, context):
        request_id, offset = request.request_id, request.from_offset
        queue = self.service.attach(request_id)  # attach first: no token slips between
        try:
            store = self.service.store
            state = await asyncio.to_thread(store.read_state, request_id)
            if state is None:
                raise UnknownRequest(f"request {request_id} is not known (or expired)")
            tokens = await asyncio.to_thread(store.read_tokens, request_id, 0)
        except ConveyorError as exc:
            if queue is not None:
                self.service.unsubscribe(request_id, queue)
            await abort_with(context, exc)
        finish = _FINISHED_STATES.get(state.value)
        try:
            yield delta_to_pb(
                TokenDelta(
                    request_id, tokens[offset:], offset, finish if queue is None or finish else None
                )
            )
            if queue is None or finish:
                return
            delivered = len(tokens)
            while True:
                delta = await queue.get()
                skip = max(0, delivered - delta.offset)
                if skip or delta.finish_reason is None or delta.token_ids:
                    delta = TokenDelta(
                        request_id, delta.token_ids[skip:], delta.offset + skip, delta.finish_reason
                    )
                delivered = max(delivered, delta.offset + len(delta.token_ids))
                yield delta_to_pb(delta)
                if delta.finish_reason is not None:
                    return
        finally:
            if queue is not None:
                self.service.unsubscribe(request_id, queue)

    async def GetStats(self, request, context):
        return await stats_to_pb(self.service, reset_timelines=request.reset_timelines)


async def stats_to_pb(
    service: SchedulerService, reset_timelines: bool = False
) -> scheduler_pb2.SchedulerStats:
    msg = scheduler_pb2.SchedulerStats(
        num_stages=len(service.pipeline.addresses),
        serving=service.serving,
        scheduling=service.options.scheduling,
        num_steps=service.counters.num_steps,
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
    msg.num_inflight = service.inflight
    if service.counters.num_steps:
        msg.mean_schedule_us = 1e6 * service.counters.schedule_s / service.counters.num_steps
    for request_id in core.running:
        msg.request_blocks[request_id] = len(core.block_manager.block_table(request_id))
    try:
        timelines = await service.pipeline.timelines(reset=reset_timelines)
        msg.bubble_fraction.extend(t.bubble_fraction for t in timelines)
    except grpc.RpcError:
        pass  # a stage is gone; the stats say serving=false
    return msg


async def serve(args, options: ServiceOptions) -> None:
    from services.common.redis_auth import redis_connection_kwargs
    from services.common.redis_server import RedisServer
    from services.scheduler.observability import install as install_observers
    from services.scheduler.store import RedisStateStore
    from services.scheduler.timeline import write_chrome_trace

    redis_server = None
    redis_url = args.redis_url
    if not redis_url:
        redis_server = RedisServer().start()
        redis_url = redis_server.url
        logger.warning("no --redis-url: using a private redis-server; state will not survive it")
    store = RedisStateStore(
        redis_url, finished_ttl_s=args.finished_ttl, **redis_connection_kwargs(os.environ)
    )
    pipeline = Pipeline([a.strip() for a in args.workers.split(",") if a.strip()])
    service = SchedulerService(options, pipeline, store)
    close_observers = install_observers(
        service, store, args.metrics_port, args.otlp_endpoint, args.trace_scheduler
    )

    server = grpc.aio.server()
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(SchedulerServicer(service), server)
    reflection.enable_server_reflection(
        [
            SERVICE_NAME,
            reflection.SERVICE_NAME,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
        ],
        server,
    )
    server.add_insecure_port(f"{args.host}:{args.port}")
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    await health_servicer.set("liveness", health_pb2.HealthCheckResponse.SERVING)
    await server.start()

    def on_serving_change(serving: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ("", SERVICE_NAME):
            asyncio.ensure_future(health_servicer.set(name, status))

    service.on_serving_change(on_serving_change)
    logger.info("scheduler on port %d waiting for %d stages", args.port, len(pipeline.addresses))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    starter = asyncio.create_task(service.start())
    await asyncio.wait(
        {starter, asyncio.ensure_future(stop.wait())}, return_when=asyncio.FIRST_COMPLETED
    )
    if starter.done() and starter.exception():
        raise starter.exception()
    await stop.wait()
    await health_servicer.enter_graceful_shutdown()
    if args.timeline and service.scheduler is not None:
        try:
            timelines = await pipeline.timelines(include_steps=True)
            write_chrome_trace(timelines, args.timeline)
            logger.info("wrote the pipeline timeline to %s", args.timeline)
        except grpc.RpcError as exc:
            logger.warning("could not collect the timeline: %s", exc.code().name)
    starter.cancel()
    await server.stop(grace=3)
    await service.stop()
    close_observers()
    store.close()
    if redis_server:
        redis_server.stop()

"""A scheduler's TokenDelta as the router's relay takes it, and its health as the router
reads it (services/router/upstream.py)."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.errors import RequestFailed
from services.common.proto.conveyor.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from services.router.session import SchedulerSession
from services.router.upstream import MAX_LATE_HEALTH_CHECKS, SchedulerClient, delta_from_pb


def test_tokens_already_delivered_are_dropped():
    msg = scheduler_pb2.TokenDelta(token_ids=[5, 6, 7], offset=2)
    delta = delta_from_pb(msg, 3)
    assert (delta.offset, delta.token_ids, delta.finish_reason) == (3, [6, 7], None)


def test_a_gap_before_tokens_or_a_finish_fails_the_request():
    with pytest.raises(RequestFailed, match="skipped tokens 3..4"):
        delta_from_pb(scheduler_pb2.TokenDelta(token_ids=[9], offset=5), 3)
    finish = scheduler_pb2.TokenDelta(offset=5, finish_reason=common_pb2.FINISH_REASON_LENGTH)
    with pytest.raises(RequestFailed, match="skipped tokens 3..4"):
        delta_from_pb(finish, 3)


def test_a_move_without_tokens_stays_where_the_stream_is():
    """A scheduler letting go of a request another pipeline adopted counts tokens the store
    refused, which it never streamed: the stream resumes from what it delivered."""
    msg = scheduler_pb2.TokenDelta(offset=10, owner_pipeline_id="p0")
    delta = delta_from_pb(msg, 2)
    assert (delta.offset, delta.token_ids, delta.finish_reason) == (2, [], None)


async def _serve(add_servicer, servicer) -> tuple[grpc.aio.Server, str]:
    """A gRPC server on loopback serving `servicer`, started; (server, its address)."""
    server = grpc.aio.server()
    add_servicer(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


class LateHealth(health_pb2_grpc.HealthServicer):
    """A scheduler's health service that answers `status` after `delay_s`."""

    def __init__(self):
        self.delay_s = 0.0
        self.status = health_pb2.HealthCheckResponse.SERVING

    async def Check(self, request, context):  # noqa: N802 - the gRPC method's name
        await asyncio.sleep(self.delay_s)
        return health_pb2.HealthCheckResponse(status=self.status)


def test_a_late_health_answer_is_not_taken_for_a_scheduler_down():
    """Real gRPC on loopback. Health checks that time out keep the last verdict until
    MAX_LATE_HEALTH_CHECKS do in a row (a starved scheduler is slow, not gone; one missed
    poll marked it down and turned the router NOT_SERVING); NOT_SERVING and a refused
    connection count at once."""

    async def main():
        servicer = LateHealth()
        server, address = await _serve(health_pb2_grpc.add_HealthServicer_to_server, servicer)
        client = SchedulerClient(address)
        verdicts = [await client.is_serving(0.2)]
        servicer.delay_s = 1.0
        verdicts += [await client.is_serving(0.05) for _ in range(MAX_LATE_HEALTH_CHECKS)]
        servicer.delay_s = 0.0
        verdicts.append(await client.is_serving(0.5))
        servicer.delay_s = 1.0
        verdicts.append(await client.is_serving(0.05))  # late again: counted from zero
        servicer.delay_s, servicer.status = 0.0, health_pb2.HealthCheckResponse.NOT_SERVING
        verdicts.append(await client.is_serving(0.5))
        servicer.status = health_pb2.HealthCheckResponse.SERVING
        verdicts.append(await client.is_serving(0.5))
        await server.stop(grace=0)
        verdicts.append(await client.is_serving(0.5))  # refused
        await client.close()
        return verdicts

    late = [True] * (MAX_LATE_HEALTH_CHECKS - 1) + [False]
    assert asyncio.run(main()) == [True, *late, True, True, False, True, False]


class BreakingScheduler(scheduler_pb2_grpc.SchedulerServicer):
    """Ends every session with UNAVAILABLE at its first command (a scheduler going away)."""

    async def Session(self, request_iterator, context):  # noqa: N802 - the gRPC method's name
        async for _ in request_iterator:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "going away")


def _senders() -> list[asyncio.Task]:
    """gRPC's tasks that send a stream's requests, still running."""
    return [t for t in asyncio.all_tasks() if "consume_request_iterator" in repr(t.get_coro())]


def test_a_broken_session_leaves_no_task_sending_its_commands():
    """Real gRPC on loopback. A session the scheduler ended stops gRPC's task that sends its
    commands; left waiting for the next command, it was destroyed pending when the router
    dropped the session (ERROR lines in the router's log after every failover)."""

    async def main():
        server, address = await _serve(
            scheduler_pb2_grpc.add_SchedulerServicer_to_server, BreakingScheduler()
        )
        async with grpc.aio.insecure_channel(address) as channel:
            session = SchedulerSession(scheduler_pb2_grpc.SchedulerStub(channel), None)
            submit = scheduler_pb2.SubmitRequest(request_id="a")
            stream = session.open(scheduler_pb2.SessionRequest(submit=submit))
            with pytest.raises(grpc.aio.AioRpcError) as broken:
                await asyncio.wait_for(stream.read(), 30)
            for _ in range(100):
                if not _senders():
                    break
                await asyncio.sleep(0.05)
            left = [repr(t) for t in _senders()]  # as they were then
            await session.close()
        await server.stop(grace=0)
        return broken.value.code(), left

    code, left = asyncio.run(main())
    assert code is grpc.StatusCode.UNAVAILABLE
    assert left == []


class SilentScheduler(scheduler_pb2_grpc.SchedulerServicer):
    """Reads every command and answers none (a scheduler the router will find lost)."""

    def __init__(self):
        self.commands = 0
        self.cancelled = asyncio.Event()

    async def Session(self, request_iterator, context):  # noqa: N802 - the gRPC method's name
        context.add_done_callback(lambda _: self.cancelled.set())
        async for _ in request_iterator:
            self.commands += 1
        await asyncio.sleep(3600)
        yield scheduler_pb2.SessionResponse()


def test_a_dropped_session_breaks_its_streams_unavailable_and_ends_the_call():
    """Real gRPC on loopback. The router drops its session to a scheduler it finds lost: the
    call ends (a stopped scheduler that wakes reads none of what it had not read), its
    streams break with UNAVAILABLE, which the relay resumes elsewhere, and the next command
    opens a new session."""

    async def main():
        servicer = SilentScheduler()
        server, address = await _serve(scheduler_pb2_grpc.add_SchedulerServicer_to_server, servicer)
        client = SchedulerClient(address)
        submit = scheduler_pb2.SessionRequest(submit=scheduler_pb2.SubmitRequest(request_id="a"))
        stream = client.open(submit)
        while servicer.commands < 1:
            await asyncio.sleep(0.01)
        client.drop_session("pipeline p1 is lost")
        with pytest.raises(grpc.aio.AioRpcError) as broken:
            await asyncio.wait_for(stream.read(), 30)
        await asyncio.wait_for(servicer.cancelled.wait(), 30)
        client.open(submit)  # on a new session
        while servicer.commands < 2:
            await asyncio.sleep(0.01)
        await client.close()
        await server.stop(grace=0)
        return broken.value

    broken = asyncio.run(main())
    assert broken.code() is grpc.StatusCode.UNAVAILABLE
    assert "pipeline p1 is lost" in broken.details()

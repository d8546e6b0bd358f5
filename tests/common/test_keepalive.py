"""Keepalive pings (services/common/keepalive.py), against real processes stopped with
SIGSTOP: a peer that stops answering without closing its connection, as a host that lost
its network would. A server drops a client that stopped (its calls are cancelled), and a
Conveyor channel fails its calls to a server that stopped, instead of waiting for ever."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys

import grpc
import pytest

from services.common.security import ClientSecurity
from services.common.serving import GrpcServer
from tests.conftest import free_port

SERVICE = "test.Keepalive"
FAST = (1.0, 1.0)  # ping every second, give up after one more
GIVE_UP_S = 60  # far beyond FAST: only a missing ping fails the tests

HOLDING_CLIENT = """
import sys, time, grpc
channel = grpc.insecure_channel(sys.argv[1])  # a foreign client: no keepalive of its own
call = channel.unary_stream("/test.Keepalive/Hold")(b"")
next(call)
print("ready", flush=True)
time.sleep(600)
"""

HOLDING_SERVER = """
import asyncio, sys, grpc

async def hold(request, context):
    yield b"first"
    await asyncio.Event().wait()

async def main():
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "test.Keepalive", {"Hold": grpc.unary_stream_rpc_method_handler(hold)}),))
    server.add_insecure_port(sys.argv[1])
    await server.start()
    print("ready", flush=True)
    await server.wait_for_termination()

asyncio.run(main())
"""


def _start(script: str, address: str) -> subprocess.Popen:
    child = subprocess.Popen(
        [sys.executable, "-c", script, address], stdout=subprocess.PIPE, text=True
    )
    assert child.stdout.readline().strip() == "ready"
    return child


@pytest.fixture
def children():
    started: list[subprocess.Popen] = []
    yield started
    for child in started:
        child.kill()  # a stopped process dies of SIGKILL too
        child.wait()


def test_a_server_drops_a_client_that_stopped_answering(children):
    async def main():
        cancelled = asyncio.Event()

        async def hold(request, context):
            yield b"first"
            try:
                await asyncio.Event().wait()
            finally:
                cancelled.set()

        port = free_port()
        server = GrpcServer("probe", "127.0.0.1", port, [SERVICE], keepalive_s=FAST)
        server.server.add_generic_rpc_handlers(
            (
                grpc.method_handlers_generic_handler(
                    SERVICE, {"Hold": grpc.unary_stream_rpc_method_handler(hold)}
                ),
            )
        )
        await server.start()
        try:
            client = await asyncio.to_thread(_start, HOLDING_CLIENT, f"127.0.0.1:{port}")
            children.append(client)
            os.kill(client.pid, signal.SIGSTOP)
            await asyncio.wait_for(cancelled.wait(), GIVE_UP_S)
        finally:
            await server.stop(grace_s=0)

    asyncio.run(main())


def test_a_conveyor_channel_fails_calls_to_a_server_that_stopped(children):
    address = f"127.0.0.1:{free_port()}"
    server = _start(HOLDING_SERVER, address)
    children.append(server)

    async def main():
        async with ClientSecurity().channel(address, keepalive_s=FAST) as channel:
            call = channel.unary_stream(f"/{SERVICE}/Hold")(b"")
            assert await call.read() == b"first"
            os.kill(server.pid, signal.SIGSTOP)
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                await asyncio.wait_for(call.read(), GIVE_UP_S)
            assert failed.value.code() == grpc.StatusCode.UNAVAILABLE

    asyncio.run(main())


def test_every_conveyor_channel_tries_a_server_that_went_away_again_within_a_second(
    monkeypatch,
):
    # grpc's default backoff grows to 120 s: a router whose scheduler was down for 30 s took
    # 11 to 15 s more to see it back (docs/deployment.md, "Faults and durability"). The cap
    # is an option of every channel the services make (all through ClientSecurity), so it
    # is checked on what they pass.
    made = []

    def record(address, options=()):
        made.append(dict(options))

    monkeypatch.setattr(grpc, "insecure_channel", record)
    monkeypatch.setattr(grpc.aio, "insecure_channel", record)
    ClientSecurity().channel("127.0.0.1:1")
    ClientSecurity().channel("127.0.0.1:1", keepalive_s=FAST)
    ClientSecurity().sync_channel("127.0.0.1:1")
    assert len(made) == 3
    for options in made:
        assert options["grpc.max_reconnect_backoff_ms"] == 1000
        assert options["grpc.dns_min_time_between_resolutions_ms"] == 1000  # grpc's: 30 s

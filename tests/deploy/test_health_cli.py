"""`conveyor health`: the exit status container healthchecks rely on, against a real gRPC server."""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from services.common import health_cli
from tests.conftest import free_port

REPO = Path(__file__).resolve().parents[2]


class HealthServer:
    """A grpc.aio server with only the standard health service, on its own event loop thread."""

    def __init__(self) -> None:
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self.servicer = health.aio.HealthServicer()

    def _call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=30)

    async def _start(self) -> None:
        self._server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(self.servicer, self._server)
        self._server.add_insecure_port(self.address)
        await self._server.start()

    def start(self) -> None:
        self._thread.start()
        self._call(self._start())

    def set(self, service: str, status: int) -> None:
        self._call(self.servicer.set(service, status))

    def stop(self) -> None:
        self._call(self._server.stop(grace=None))
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)


@pytest.fixture
def server() -> Iterator[HealthServer]:
    srv = HealthServer()
    srv.start()
    yield srv
    srv.stop()


def check(address: str, service: str = "", timeout: float = 5.0, wait: float | None = None) -> int:
    parser = argparse.ArgumentParser()
    health_cli.add_arguments(parser)
    argv = [address, "--service", service, "--timeout", str(timeout)]
    if wait is not None:
        argv += ["--wait", str(wait)]
    return health_cli.run(parser.parse_args(argv))


class ServingAfterChecks(health.aio.HealthServicer):
    """Answers NOT_SERVING to the first `num_not_serving` checks, then SERVING."""

    def __init__(self, num_not_serving: int) -> None:
        super().__init__()
        self.num_not_serving = num_not_serving
        self.num_checks = 0

    async def Check(self, request, context):
        self.num_checks += 1
        status = health_pb2.HealthCheckResponse.SERVING
        if self.num_checks <= self.num_not_serving:
            status = health_pb2.HealthCheckResponse.NOT_SERVING
        await self.set(request.service, status)
        return await super().Check(request, context)


def test_health_serving_exits_zero_and_prints_status(server, capsys):
    server.set("", health_pb2.HealthCheckResponse.SERVING)
    assert check(server.address) == 0
    assert capsys.readouterr().out.strip() == "SERVING"


def test_health_not_serving_exits_one(server, capsys):
    server.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    assert check(server.address) == 1
    assert capsys.readouterr().out.strip() == "NOT_SERVING"


def test_health_follows_status_changes(server):
    server.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    assert check(server.address) == 1
    server.set("", health_pb2.HealthCheckResponse.SERVING)
    assert check(server.address) == 0


def test_health_named_service(server, capsys):
    server.set("conveyor.v1.Generation", health_pb2.HealthCheckResponse.SERVING)
    assert check(server.address, service="conveyor.v1.Generation") == 0
    assert check(server.address, service="conveyor.v1.Unknown") == 1
    assert "NOT_FOUND" in capsys.readouterr().out


def test_health_nothing_listening_exits_one(capsys):
    address = f"127.0.0.1:{free_port()}"
    assert check(address, timeout=2.0) == 1
    assert "UNAVAILABLE" in capsys.readouterr().out


def test_health_is_a_conveyor_subcommand(server):
    """The command compose healthchecks run: `conveyor health ADDR` through the real CLI."""
    server.set("", health_pb2.HealthCheckResponse.SERVING)
    cmd = [sys.executable, "-m", "services.cli", "health", server.address]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "SERVING"

    server.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert done.stdout.strip() == "NOT_SERVING"


def test_health_wait_polls_until_serving(capsys):
    srv = HealthServer()
    srv.servicer = ServingAfterChecks(num_not_serving=3)
    srv.start()
    try:
        assert check(srv.address, wait=120) == 0
    finally:
        srv.stop()
    assert srv.servicer.num_checks == 4
    assert capsys.readouterr().out.strip() == "SERVING"


def test_health_wait_sees_a_server_that_starts_later(capsys):
    """`conveyor up &` then `conveyor health ADDR --wait`: nothing listens at first."""
    srv = HealthServer()
    done: list[int] = []
    waiter = threading.Thread(target=lambda: done.append(check(srv.address, wait=120)))
    waiter.start()
    try:
        time.sleep(1.5)  # a few refused checks first; the result does not depend on this
        srv.start()
        srv.set("", health_pb2.HealthCheckResponse.SERVING)
        waiter.join(timeout=180)
    finally:
        srv.stop()
    assert done == [0]
    assert capsys.readouterr().out.strip() == "SERVING"


def test_health_wait_gives_up_with_the_last_status(server, capsys):
    server.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    assert check(server.address, wait=1) == 1
    assert capsys.readouterr().out.strip() == "NOT_SERVING"


def test_health_wait_rejects_a_negative_wait(server, capsys):
    server.set("", health_pb2.HealthCheckResponse.SERVING)
    assert check(server.address, wait=-1) == 1
    assert "--wait must be >= 0" in capsys.readouterr().out

"""The one way every service serves: the error interceptor maps what methods raise to a
status and a message, for unary and streaming methods alike; health follows set_serving."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common import errors
from services.common.serving import LIVENESS, ErrorInterceptor, GrpcServer
from tests.conftest import free_port

SERVICE = "test.Echo"


def _raise(kind: str):
    if kind == "invalid":
        raise errors.InvalidRequest("max_tokens=0 is out of range: must be >= 1")
    if kind == "full":
        raise errors.QueueFull("10 requests are waiting")
    if kind == "bug":
        raise ValueError("a bug")


async def _unary(request: bytes, context) -> bytes:
    _raise(request.decode())
    return b"ok"


async def _stream(request: bytes, context):
    yield b"first"
    _raise(request.decode())
    yield b"second"


def _handler() -> grpc.GenericRpcHandler:
    return grpc.method_handlers_generic_handler(
        SERVICE,
        {
            "Unary": grpc.unary_unary_rpc_method_handler(_unary),
            "Stream": grpc.unary_stream_rpc_method_handler(_stream),
        },
    )


@pytest.fixture
def serve():
    """Runs `body(server, channel)` against a started GrpcServer on a free port."""

    def run(body):
        async def main():
            port = free_port()
            server = GrpcServer("echo", "127.0.0.1", port, [SERVICE])
            server.server.add_generic_rpc_handlers((_handler(),))
            await server.start()
            try:
                async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                    return await body(server, channel)
            finally:
                await server.stop(grace_s=0)

        return asyncio.run(main())

    return run


@pytest.mark.parametrize(
    "kind,code,message",
    [
        ("invalid", grpc.StatusCode.INVALID_ARGUMENT, "max_tokens=0 is out of range: must be >= 1"),
        ("full", grpc.StatusCode.RESOURCE_EXHAUSTED, "10 requests are waiting"),
        ("bug", grpc.StatusCode.INTERNAL, "internal error in the echo: ValueError: a bug"),
    ],
)
def test_error_interceptor_maps_exceptions_of_unary_and_streaming_methods(
    serve, kind, code, message
):
    async def body(server, channel):
        unary = channel.unary_unary(f"/{SERVICE}/Unary")
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await unary(kind.encode())
        assert (caught.value.code(), caught.value.details()) == (code, message)
        assert await unary(b"fine") == b"ok"

        received = []
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            async for item in channel.unary_stream(f"/{SERVICE}/Stream")(kind.encode()):
                received.append(item)
        assert received == [b"first"]  # what was sent before the error still arrives
        assert (caught.value.code(), caught.value.details()) == (code, message)

    serve(body)


def test_health_follows_set_serving_and_liveness_is_always_serving(serve):
    async def body(server, channel):
        stub = health_pb2_grpc.HealthStub(channel)

        async def status(name: str = "") -> int:
            return (await stub.Check(health_pb2.HealthCheckRequest(service=name))).status

        serving, not_serving = (
            health_pb2.HealthCheckResponse.SERVING,
            health_pb2.HealthCheckResponse.NOT_SERVING,
        )
        assert (await status(), await status(SERVICE)) == (not_serving, not_serving)
        assert await status(LIVENESS) == serving
        await server.set_serving(True)
        assert (await status(), await status(SERVICE)) == (serving, serving)

    serve(body)


def test_a_taken_port_is_a_config_error_naming_it():
    async def main():
        port = free_port()
        first = GrpcServer("first", "127.0.0.1", port, [SERVICE])
        await first.start()
        try:
            with pytest.raises(
                errors.ConfigError, match=f"second cannot listen on 127.0.0.1:{port}"
            ):
                await GrpcServer("second", "127.0.0.1", port, [SERVICE]).start()
        finally:
            await first.stop(grace_s=0)

    asyncio.run(main())


def test_a_call_cut_by_the_servers_own_stop_logs_no_error(caplog):
    """grpc raises _ServerStoppedError in a handler still reading when the server stops
    (seen in 2 of 5 stops of a stack: an ERROR traceback on a normal SIGTERM)."""
    from grpc._cython.cygrpc import _ServerStoppedError

    async def reading(request, context):
        yield b"first"
        raise _ServerStoppedError("Server already stopped.")

    class Context:
        aborted = None

        async def abort(self, code, message):
            self.aborted = (code, message)

    async def main():
        interceptor = ErrorInterceptor("echo")
        method = "/grpc.health.v1.Health/Watch"  # no credentials to read from this context
        stream = interceptor._wrap(reading, method, lambda request: request)
        context = Context()
        items = [item async for item in stream(b"", context)]
        return items, context.aborted

    with caplog.at_level("DEBUG"):
        items, aborted = asyncio.run(main())
    assert items == [b"first"] and aborted is None
    assert not [r for r in caplog.records if r.levelname == "ERROR"]

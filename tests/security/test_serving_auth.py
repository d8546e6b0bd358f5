"""Authentication in the one interceptor every service has (services/common/serving.py):
the authenticator's principal reaches the method, a refused call never runs it, health is
exempt, TLS and mutual TLS on the port, and a health-only plaintext port for probes."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.auth import InternalAuth, OpenAccess, current_principal
from services.common.certs import write_certs
from services.common.security import ClientSecurity, ServerSecurity
from services.common.serving import GrpcServer
from tests.conftest import free_port

SERVICE = "test.Who"


async def _whoami(request: bytes, context) -> bytes:
    return current_principal.get().name.encode()


async def _whoami_stream(request: bytes, context):
    yield current_principal.get().name.encode()


def _handler() -> grpc.GenericRpcHandler:
    return grpc.method_handlers_generic_handler(
        SERVICE,
        {
            "Unary": grpc.unary_unary_rpc_method_handler(_whoami),
            "Stream": grpc.unary_stream_rpc_method_handler(_whoami_stream),
        },
    )


def _serve(security: ServerSecurity, client: ClientSecurity, body, health_port=None):
    async def main():
        port = free_port()
        server = GrpcServer(
            "who", "127.0.0.1", port, [SERVICE], security=security, health_port=health_port
        )
        server.server.add_generic_rpc_handlers((_handler(),))
        await server.start()
        await server.set_serving(True)
        try:
            async with client.channel(f"127.0.0.1:{port}") as channel:
                return await body(channel)
        finally:
            await server.stop(grace_s=0)

    return asyncio.run(main())


async def _who(channel, metadata=None) -> tuple[str, str]:
    unary = await channel.unary_unary(f"/{SERVICE}/Unary")(b"", metadata=metadata)
    stream = [m async for m in channel.unary_stream(f"/{SERVICE}/Stream")(b"", metadata=metadata)]
    return unary.decode(), b"".join(stream).decode()


async def _refused(channel, metadata=None) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await channel.unary_unary(f"/{SERVICE}/Unary")(b"", metadata=metadata)
    return caught.value.code(), caught.value.details()


async def _health(channel) -> int:
    reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
    return reply.status


def test_open_access_makes_every_caller_anonymous():
    async def body(channel):
        assert await _who(channel) == ("anonymous", "anonymous")

    _serve(ServerSecurity(OpenAccess()), ClientSecurity(), body)


def test_internal_token_is_required_and_health_is_exempt():
    security = ServerSecurity(InternalAuth("s3cret-token", requires_certificate=False))

    async def body(channel):
        code, details = await _refused(channel)
        assert code is grpc.StatusCode.UNAUTHENTICATED and "internal token" in details
        code, details = await _refused(channel, (("authorization", "Bearer wrong"),))
        assert code is grpc.StatusCode.UNAUTHENTICATED and "not valid" in details
        code, details = await _refused(channel, (("authorization", "Basic abc"),))
        assert code is grpc.StatusCode.UNAUTHENTICATED and "Bearer" in details
        good = ClientSecurity(token="s3cret-token").metadata
        assert await _who(channel, good) == ("internal", "internal")
        assert await _health(channel) == health_pb2.HealthCheckResponse.SERVING

    _serve(security, ClientSecurity(), body)


def test_mutual_tls_gives_the_certificate_identity_and_refuses_strangers(tmp_path):
    ours = write_certs(tmp_path / "ours")
    client_files = write_certs(tmp_path / "ours", name="operator")
    stranger = write_certs(tmp_path / "theirs")
    security = ServerSecurity.from_files(
        InternalAuth("tok", requires_certificate=True), ours.cert, ours.key, client_ca=ours.ca
    )
    operator = ClientSecurity.from_files(ours.ca, client_files.cert, client_files.key, "tok")

    async def body(channel):
        assert await _who(channel, operator.metadata) == ("conveyor-operator",) * 2

    _serve(security, operator, body)
    for client in (
        ClientSecurity(token="tok"),  # plaintext
        ClientSecurity.from_files(ours.ca, token="tok"),  # no client certificate
        ClientSecurity.from_files(ours.ca, stranger.cert, stranger.key, "tok"),  # foreign CA
    ):

        async def refused(channel, client=client):
            code, _ = await _refused(channel, client.metadata)
            assert code is grpc.StatusCode.UNAVAILABLE

        _serve(security, client, refused)


def test_health_port_serves_health_alone_in_plaintext(tmp_path):
    files = write_certs(tmp_path / "certs")
    security = ServerSecurity.from_files(OpenAccess(), files.cert, files.key)
    health_port = free_port()

    async def body(channel):
        assert await _who(channel) == ("anonymous", "anonymous")  # over TLS
        async with grpc.aio.insecure_channel(f"127.0.0.1:{health_port}") as plain:
            assert await _health(plain) == health_pb2.HealthCheckResponse.SERVING
            code, _ = await _refused(plain)
            assert code is grpc.StatusCode.UNIMPLEMENTED

    _serve(security, ClientSecurity.from_files(files.ca), body, health_port=health_port)

"""One way to serve a Conveyor gRPC service: start, health, reflection, signals, drain.

Every service (router, scheduler, stage worker) runs the same sequence::

    server = GrpcServer("scheduler", config.host, config.port, [SERVICE_NAME])
    server.add(scheduler_pb2_grpc.add_SchedulerServicer_to_server, SchedulerServicer(...))
    await server.start()              # health: NOT_SERVING ("" and each service), liveness SERVING
    await server.set_serving(True)    # once it can do its work
    await server.wait_for_stop()      # SIGTERM / SIGINT
    await server.stop(grace_s=5)      # health NOT_SERVING, in-flight RPCs get `grace_s`

Errors become statuses in one place: `ErrorInterceptor` wraps every method of the server,
so servicers and the pure code under them raise the domain exceptions of
services/common/errors.py and never call `context.abort` themselves. An exception that is
not a `ConveyorError` is a bug: it is logged with its traceback and answered INTERNAL.

Authentication happens there too: before a method runs, the service's `Authenticator`
(`ServerSecurity`, services/common/security.py) turns the call's credentials into a
`Principal` that the servicer reads from `services.common.auth.current_principal`, or the
call ends UNAUTHENTICATED. grpc.health.v1 is exempt (probes); with TLS on, `health_port`
serves it alone in plaintext, for probes that cannot speak TLS (the kubelet's).
The interceptor also parses the request messages itself, so that bytes that are not the
method's message (garbage, invalid UTF-8 in a string field) are INVALID_ARGUMENT, not the
UNKNOWN grpc answers when its own deserializer fails.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import signal
from collections.abc import Callable, Sequence

import grpc
from grpc._cython.cygrpc import _ServerStoppedError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from services.common import errors, keepalive
from services.common.auth import current_principal
from services.common.security import ServerSecurity, call_credentials, log_security

logger = logging.getLogger(__name__)

HEALTH_SERVICE = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
_HEALTH_METHODS = f"/{HEALTH_SERVICE}/"
LIVENESS = "liveness"
"""Health service name that is SERVING while the process is alive (liveness probes)."""

_CODES: list[tuple[type[BaseException], grpc.StatusCode]] = [
    (errors.InvalidRequest, grpc.StatusCode.INVALID_ARGUMENT),
    (errors.ConfigError, grpc.StatusCode.INVALID_ARGUMENT),
    (errors.ModelLoadError, grpc.StatusCode.FAILED_PRECONDITION),  # e.g. no chat template
    (errors.QueueFull, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (errors.UnknownRequest, grpc.StatusCode.NOT_FOUND),
    (errors.ModelNotFound, grpc.StatusCode.NOT_FOUND),
    (errors.RequestExists, grpc.StatusCode.ALREADY_EXISTS),
    (errors.Unauthenticated, grpc.StatusCode.UNAUTHENTICATED),
    (errors.PermissionDenied, grpc.StatusCode.PERMISSION_DENIED),
    (errors.PipelineUnavailable, grpc.StatusCode.UNAVAILABLE),
    (errors.StateStoreError, grpc.StatusCode.UNAVAILABLE),
    (errors.RequestFailed, grpc.StatusCode.INTERNAL),
]


def status_for(exc: BaseException) -> grpc.StatusCode:
    """The status code for a domain exception; INTERNAL for anything unexpected."""
    for exc_type, code in _CODES:
        if isinstance(exc, exc_type):
            return code
    return grpc.StatusCode.INTERNAL


def message_for(exc: BaseException, service: str = "service") -> str:
    """What the client reads: a domain error's own message, never a traceback."""
    if isinstance(exc, errors.ConveyorError):
        return str(exc)
    return f"internal error in the {service}: {type(exc).__name__}: {exc}"


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Authenticates every call and maps exceptions raised by any method of the server to a
    status and a message.

    Wraps the handler of every method (unary or streaming, either side), so that a
    servicer is plain code that raises. The natural place for checks every call shares.
    """

    def __init__(self, service: str, security: ServerSecurity | None = None):
        self.service = service
        self.authenticator = (security or ServerSecurity()).authenticator

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        kind = {
            (False, False): "unary_unary",
            (False, True): "unary_stream",
            (True, False): "stream_unary",
            (True, True): "stream_stream",
        }[(handler.request_streaming, handler.response_streaming)]
        behaviour = getattr(handler, kind)
        parse = _parser(handler.request_deserializer, handler.request_streaming)
        # grpc hands the raw bytes on (no deserializer); `parse` turns them into the message
        wrapped = self._wrap(behaviour, method, parse)
        return handler._replace(request_deserializer=None, **{kind: wrapped})

    def _wrap(self, behaviour: Callable, method: str, parse: Callable) -> Callable:
        is_exempt = method.startswith(_HEALTH_METHODS)
        if inspect.isasyncgenfunction(behaviour):

            async def stream(request, context):
                try:
                    if not is_exempt:
                        self._authenticate(context, method)
                    async for item in behaviour(parse(request), context):
                        yield item
                except Exception as exc:  # noqa: BLE001 - the one place errors become statuses
                    await self._abort(context, exc, method)

            return stream

        async def unary(request, context):
            try:
                if not is_exempt:
                    self._authenticate(context, method)
                return await behaviour(parse(request), context)
            except Exception as exc:  # noqa: BLE001
                await self._abort(context, exc, method)

        return unary

    def _authenticate(self, context: grpc.aio.ServicerContext, method: str) -> None:
        """Sets the call's principal (each RPC runs in a task of its own, so the value is
        this call's); raises Unauthenticated."""
        try:
            principal = self.authenticator.authenticate(call_credentials(context))
        except errors.Unauthenticated as exc:
            logger.info("%s refused %s from %s: %s", self.service, method, context.peer(), exc)
            raise
        current_principal.set(principal)

    async def _abort(self, context: grpc.aio.ServicerContext, exc: Exception, method: str):
        if isinstance(exc, grpc.aio.AbortError):
            raise exc
        if isinstance(exc, _ServerStoppedError):  # a call cut by our own stop: no error
            logger.debug("%s %s ended by the server's stop", self.service, method)
            return
        code = status_for(exc)
        if code is grpc.StatusCode.INTERNAL and not isinstance(exc, errors.ConveyorError):
            logger.error("%s %s failed", self.service, method, exc_info=exc)
        await context.abort(code, message_for(exc, self.service))


def _parser(deserializer: Callable | None, is_streaming: bool) -> Callable:
    """request (raw bytes, or an async iterator of them) -> what the servicer expects, with
    `InvalidRequest` for bytes that are not a valid message."""
    if deserializer is None:
        return lambda request: request
    message_type = getattr(deserializer, "__self__", None)
    name = getattr(getattr(message_type, "DESCRIPTOR", None), "full_name", "request")

    def parse_one(raw: bytes):
        try:
            return deserializer(raw)
        except Exception as exc:  # noqa: BLE001 - protobuf raises DecodeError, others differ
            raise errors.InvalidRequest(
                f"the request is not a valid {name} message ({len(raw)} bytes): "
                "a string field holds invalid UTF-8, or the bytes are not that message"
            ) from exc

    if not is_streaming:
        return parse_one

    async def parse_each(raw_iterator):
        async for raw in raw_iterator:
            yield parse_one(raw)

    return parse_each


class GrpcServer:
    """A `grpc.aio` server with the standard health service, reflection, the error and
    authentication interceptor, TLS, SIGTERM handling and a graceful stop."""

    def __init__(
        self,
        name: str,
        host: str,
        port: int,
        service_names: Sequence[str],
        options: Sequence[tuple[str, object]] = (),
        reflection_pool=None,
        security: ServerSecurity | None = None,
        health_port: int | None = None,
        max_concurrent_rpcs: int | None = None,
        keepalive_s: tuple[float, float] = (keepalive.PING_INTERVAL_S, keepalive.PING_TIMEOUT_S),
    ):
        """
        Args:
            name: the service in logs and internal-error messages ("router", "stage 1").
            service_names: full names of the services added; their health follows
                `set_serving` along with the overall ("") status.
            options: grpc server options (message size limits).
            reflection_pool: a descriptor pool for reflection (the router's KServe protos
                live in a private pool); None: the default pool.
            security: TLS and the authenticator of calls; None: plaintext, anyone.
            health_port: a second, plaintext port on `host` serving grpc.health.v1 only.
            max_concurrent_rpcs: RPCs served at once; grpc answers one more with
                RESOURCE_EXHAUSTED. None: no limit.
            keepalive_s: (interval, timeout) of the pings to clients (services/common/keepalive.py).
        """
        self.name = name
        self.host = host
        self.address = f"{host}:{port}"
        self.service_names = list(service_names)
        self.security = security or ServerSecurity()
        # No SO_REUSEPORT: a second process on a taken port is an error, not a silent share
        # of the first one's connections.
        pings = keepalive.server_options(*keepalive_s)
        options = [("grpc.so_reuseport", 0), *pings, *options]
        interceptor = ErrorInterceptor(name, self.security)
        self.server = grpc.aio.server(
            interceptors=[interceptor],
            options=options,
            maximum_concurrent_rpcs=max_concurrent_rpcs,
        )
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.health_server = None
        self.health_address = None
        if health_port is not None:
            self.health_address = f"{host}:{health_port}"
            self.health_server = grpc.aio.server(options=[("grpc.so_reuseport", 0), *pings])
            health_pb2_grpc.add_HealthServicer_to_server(self.health, self.health_server)
        reflection.enable_server_reflection(
            [*self.service_names, HEALTH_SERVICE, reflection.SERVICE_NAME],
            self.server,
            pool=reflection_pool,
        )
        self._stop = asyncio.Event()

    def add(self, add_to_server: Callable, servicer) -> None:
        """Registers a servicer with its generated `add_*Servicer_to_server` function."""
        add_to_server(servicer, self.server)

    async def start(self) -> None:
        """Binds and starts; health says NOT_SERVING until `set_serving(True)`."""
        await self.set_serving(False)
        await self.health.set(LIVENESS, health_pb2.HealthCheckResponse.SERVING)
        self._bind(self.server, self.address, self.security.credentials())
        if self.health_server is not None:
            self._bind(self.health_server, self.health_address, None)
            await self.health_server.start()
        await self.server.start()
        log_security(self.name, self.address, self.security, self.host)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stop.set)

    def _bind(self, server: grpc.aio.Server, address: str, credentials) -> None:
        try:
            if credentials is None:
                server.add_insecure_port(address)
            else:
                server.add_secure_port(address, credentials)
        except RuntimeError as exc:
            raise errors.ConfigError(
                f"{self.name} cannot listen on {address} ({exc}): the port is taken or "
                "the address is not this machine's"
            ) from exc

    async def set_serving(self, is_serving: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if is_serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ("", *self.service_names):
            await self.health.set(name, status)

    def request_stop(self) -> None:
        """What SIGTERM does: `wait_for_stop` returns."""
        self._stop.set()

    async def wait_for_stop(self) -> None:
        await self._stop.wait()

    async def stop(self, grace_s: float = 5.0) -> None:
        """Health NOT_SERVING for everyone (liveness too), then a graceful stop."""
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace=grace_s)
        if self.health_server is not None:
            await self.health_server.stop(grace=None)

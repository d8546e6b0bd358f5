"""uvicorn inside the router's event loop (`--http-port`): one process, one scheduler
connection, one tokenizer for both APIs.

uvicorn's `Server.serve()` would install its own SIGTERM/SIGINT handlers and exit the process
when the port is taken; the router owns the signals (it drains gRPC and HTTP together) and
reports a taken port as a ConfigError, so we bind the socket ourselves and drive uvicorn's
startup / main loop / shutdown steps.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
from dataclasses import dataclass, field

import uvicorn

from services.common.errors import ConfigError

logger = logging.getLogger(__name__)


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on host:port ("[::]" or "::" listens on IPv6 and IPv4, or IPv4
    alone on a machine without IPv6). Raises ConfigError when the port cannot be had."""
    host = host.strip("[]")
    try:
        if host == "::" and not socket.has_dualstack_ipv6():
            host = "0.0.0.0"
        if ":" in host:
            return socket.create_server(
                (host, port), family=socket.AF_INET6, dualstack_ipv6=host == "::"
            )
        return socket.create_server((host, port))
    except OSError as exc:
        raise ConfigError(
            f"--http-port={port}: cannot listen on {host} ({exc.strerror}); pick a free port"
        ) from exc


HEADER_TIMEOUT_S = 10.0
"""A connection that has not sent a whole request head this long after it opened, or after
its last response, is closed (uvicorn has no such timeout: idle or trickling connections
stayed open for good and, counted against its limit, kept everyone else out)."""


WRITE_TIMEOUT_S = 60.0
"""A connection whose client has taken none of its response this long (the socket's buffers
full, uvicorn's writes paused) is dropped, as if the client had gone: its request is
aborted and its slot freed (uvicorn waits for ever, and a client whose host vanished held
its request until TCP gave up, ~15 minutes later)."""


def guarded(protocol: type, max_connections: int | None) -> type:
    """uvicorn's HTTP protocol class with a request-head timeout, a write timeout and a
    connection cap (a connection over the cap is closed at once; requests are limited by
    the app)."""

    class Guarded(protocol):
        _write_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            if max_connections is not None and len(self.connections) > max_connections:
                logger.warning(
                    "HTTP: %d connections open (the cap is %d): closing a new one",
                    len(self.connections) - 1,
                    max_connections,
                )
                transport.close()
                return
            self._arm_head_timer()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm_head_timer()

        def _arm_head_timer(self) -> None:
            # A new request replaces `cycle`: the same one at the deadline means none came.
            armed = self.cycle
            self.loop.call_later(HEADER_TIMEOUT_S, self._close_unless_asked, armed)

        def _close_unless_asked(self, armed) -> None:
            if self.cycle is armed and not self.transport.is_closing():
                self.transport.close()

        def pause_writing(self) -> None:
            super().pause_writing()
            self._write_timer = self.loop.call_later(WRITE_TIMEOUT_S, self._drop_stalled)

        def resume_writing(self) -> None:
            super().resume_writing()
            if self._write_timer is not None:
                self._write_timer.cancel()
                self._write_timer = None

        def connection_lost(self, exc) -> None:
            if self._write_timer is not None:
                self._write_timer.cancel()
            super().connection_lost(exc)

        def _drop_stalled(self) -> None:
            logger.warning(
                "HTTP: a client took none of its response for %g s: dropping its connection",
                WRITE_TIMEOUT_S,
            )
            self.transport.abort()

    Guarded.__name__ = Guarded.__qualname__ = f"Guarded{protocol.__name__}"
    return Guarded


@dataclass
class HttpServer:
    """An ASGI app served on one port until `stop()`."""

    app: object
    host: str
    port: int
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None
    """PEM CA whose client certificates the port requires; None: none asked."""
    max_connections: int | None = None
    """Open connections at once; one more is closed as it is accepted (requests in flight
    have their own limit: app.LimitRequests)."""
    _server: uvicorn.Server | None = field(default=None, init=False)
    _loop_task: asyncio.Task | None = field(default=None, init=False)
    _sockets: list[socket.socket] = field(default_factory=list, init=False)

    def bind(self) -> None:
        """Takes the port (ConfigError when it cannot): before the gRPC server starts, so
        that a taken port stops the router before anything runs."""
        if not self._sockets:
            self._sockets = [bind(self.host, self.port)]

    async def start(self) -> None:
        self.bind()
        config = uvicorn.Config(
            self.app,
            lifespan="off",
            log_config=None,  # the router's logging setup applies
            access_log=False,  # one line per request is the metrics' job
            ssl_certfile=self.tls_cert,
            ssl_keyfile=self.tls_key,
            ssl_ca_certs=self.tls_client_ca,
            ssl_cert_reqs=ssl.CERT_REQUIRED if self.tls_client_ca else ssl.CERT_NONE,
            timeout_graceful_shutdown=5,
        )
        config.load()
        config.http_protocol_class = guarded(config.http_protocol_class, self.max_connections)
        server = uvicorn.Server(config)
        server.lifespan = config.lifespan_class(config)
        await server.startup(sockets=self._sockets)
        self._server = server
        self._loop_task = asyncio.create_task(server.main_loop())
        scheme = "https" if self.tls_cert else "http"
        logger.info("OpenAI-compatible API on %s://%s:%d/v1", scheme, self.host, self.port)

    async def stop(self) -> None:
        """Stops accepting, lets running requests finish (5 s), then closes."""
        if self._server is None:
            return
        self._server.should_exit = True
        await self._loop_task
        await self._server.shutdown(sockets=self._sockets)
        self._server = None

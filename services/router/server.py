"""`conveyor router`: the public gRPC edge (Generation, KServe v2, health, reflection)."""

from __future__ import annotations

import asyncio
import logging
import os

from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2

from services.common.auth import CertificateAuth, OpenAccess
from services.common.proto.conveyor.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from services.common.proto.inference import grpc_service_pb2 as kserve_pb2
from services.common.proto.inference import grpc_service_pb2_grpc as kserve_pb2_grpc
from services.common.security import ServerSecurity, internal_client
from services.common.serving import GrpcServer
from services.router import generation, kserve
from services.router.config import RouterConfig
from services.router.core import RouterCore
from services.router.pool import SchedulerPool
from services.router.request import ModelLimits
from services.router.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

PUBLIC_SERVICES = (generation.SERVICE_NAME, kserve.SERVICE_NAME)
MAX_CONNECTIONS_PER_REQUEST = 8
"""The HTTP API keeps up to this many connections open per request it may serve at once
(clients hold idle keep-alive connections in their pools)."""


def reflection_pool() -> descriptor_pool.DescriptorPool:
    """One pool with every service the router serves.

    The KServe stubs live in a private pool (their names clash with tritonclient's), so
    reflection gets a pool of its own holding copies of all the files.
    """
    pool = descriptor_pool.DescriptorPool()
    for file in (
        health_pb2.DESCRIPTOR,
        reflection_pb2.DESCRIPTOR,
        common_pb2.DESCRIPTOR,
        generation_pb2.DESCRIPTOR,
        kserve_pb2.DESCRIPTOR,
    ):  # dependencies first
        proto = descriptor_pb2.FileDescriptorProto()
        file.CopyToProto(proto)
        pool.Add(proto)
    return pool


async def watch_scheduler(core: RouterCore, server: GrpcServer, interval_s: float) -> None:
    """Keeps the router's health equal to the scheduler's (polled every `interval_s`)."""
    was_serving = None
    while True:
        is_serving = await core.scheduler.is_serving(timeout_s=max(interval_s, 1.0))
        core.is_ready = is_serving
        if is_serving != was_serving:
            await server.set_serving(is_serving)
            logger.info(
                "scheduler %s is %s",
                core.scheduler.address,
                "SERVING" if is_serving else "not serving",
            )
            was_serving = is_serving
        await asyncio.sleep(interval_s)


def build_core(config: RouterConfig) -> RouterCore:
    tokenizer = Tokenizer.from_dir(config.model_dir)
    limits = ModelLimits(
        name=config.model_name,
        max_model_len=config.context_length(),
        vocab_size=config.vocab_size(),
        max_stop_strings=config.max_stop_strings,
        max_stop_string_chars=config.max_stop_string_chars,
        max_prompt_bytes=config.max_prompt_bytes,
        max_json_bytes=config.max_json_bytes,
        max_json_depth=config.max_json_depth,
        max_stream_requests=config.max_stream_requests,
        request=config.request_limits,
    )
    upstream = internal_client(
        config.tls_ca, config.tls_cert, config.tls_key, config.internal_token
    )
    discovery = None
    if config.redis_url:
        discovery = announcement_reader(config.redis_url)
    scheduler = SchedulerPool(
        config.scheduler_addresses,
        config.resume_timeout_s,
        upstream,
        routing=config.routing,
        load_weight=config.routing_load_weight,
        discovery=discovery,
    )
    return RouterCore(tokenizer=tokenizer, limits=limits, scheduler=scheduler)


def announcement_reader(redis_url: str):
    """A blocking callable returning the pipelines announced in Redis now."""
    import redis
    from redis.exceptions import AuthenticationError

    from services.common.pipelines import read_announcements
    from services.common.redis_auth import redis_connection_kwargs
    from services.common.redis_url import refused_auth_message

    client = redis.Redis.from_url(
        redis_url, socket_timeout=2.0, **redis_connection_kwargs(os.environ)
    )

    def read():
        try:
            return read_announcements(client)
        except AuthenticationError as exc:  # redis-py's words alone do not say what to do
            raise ConnectionError(refused_auth_message(redis_url, exc)) from exc

    return read


def server_security(config: RouterConfig) -> ServerSecurity:
    """The public port: API keys, else client certificates, else anyone ("anonymous")."""
    from services.router.api_keys import ApiKeyAuth, load_key_file

    if config.api_key_file:
        authenticator = ApiKeyAuth(load_key_file(config.api_key_file))
    elif config.tls_client_ca:
        authenticator = CertificateAuth()
    else:
        authenticator = OpenAccess()
    return ServerSecurity.from_files(
        authenticator, config.tls_cert, config.tls_key, client_ca=config.tls_client_ca
    )


async def serve(config: RouterConfig) -> None:
    """Runs the router until SIGTERM/SIGINT, then drains gracefully."""
    security = server_security(config)
    core = build_core(config)
    close_observers = install_observers(core, config)
    http = http_server(core, config, security) if config.http_port is not None else None
    server = GrpcServer(
        "router",
        config.host,
        config.port,
        PUBLIC_SERVICES,
        options=[("grpc.max_receive_message_length", config.max_message_bytes)],
        reflection_pool=reflection_pool(),
        max_concurrent_rpcs=config.max_concurrent_rpcs,
        security=security,
        health_port=config.health_port,
    )
    server.add(
        generation_pb2_grpc.add_GenerationServicer_to_server, generation.GenerationServicer(core)
    )
    server.add(
        kserve_pb2_grpc.add_GRPCInferenceServiceServicer_to_server, kserve.KServeServicer(core)
    )
    await server.start()
    logger.info(
        "router on port %d serving %s (context %d) via scheduler %s",
        config.port,
        core.limits.name,
        core.limits.max_model_len,
        core.scheduler.address,
    )
    if http is not None:
        await http.start()
    watcher = asyncio.create_task(watch_scheduler(core, server, config.health_interval_s))
    await server.wait_for_stop()
    logger.info("router stopping: draining streams")
    watcher.cancel()
    await asyncio.gather(server.stop(grace_s=5), *([http.stop()] if http else []))
    await core.scheduler.close()
    close_observers()


def http_server(core: RouterCore, config: RouterConfig, security: ServerSecurity):
    """The OpenAI-compatible API on --http-port, over the same core (services/router/http/),
    its port taken (ConfigError when it cannot be) but not yet serving."""
    from services.router.http.app import create_app
    from services.router.http.server import HttpServer

    app = create_app(
        core, security.authenticator, config.max_message_bytes, config.max_concurrent_rpcs
    )
    http = HttpServer(
        app,
        config.host,
        config.http_port,
        tls_cert=config.tls_cert,
        tls_key=config.tls_key,
        tls_client_ca=config.tls_client_ca,
        max_connections=MAX_CONNECTIONS_PER_REQUEST * config.max_concurrent_rpcs,
    )
    http.bind()
    return http


def install_observers(core: RouterCore, config: RouterConfig):
    """Sets the core's metrics and tracing as the config asks; returns their closer."""
    from services.common.telemetry import make_tracing

    core.tracing = make_tracing(config.otlp_endpoint, "conveyor-router")
    server = None
    if config.metrics_port is not None:
        from prometheus_client import CollectorRegistry

        from services.common.metrics import RouterMetrics, serve_metrics

        registry = CollectorRegistry()
        core.metrics = RouterMetrics(registry, core.limits.name)
        server = serve_metrics(registry, config.metrics_port)

    def close() -> None:
        if server is not None:
            server.close()
        if core.tracing is not None:
            core.tracing.shutdown()

    return close

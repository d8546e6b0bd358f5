"""`conveyor router` flags; the service itself is in services/router/server.py."""

from __future__ import annotations

import argparse
import os

from services.common.config import default_of
from services.common.credentials import internal_token
from services.common.security import add_internal_token_argument, add_tls_arguments
from services.router.config import DEFAULT_PORT, RouterConfig
from services.router.routing import RoutingPolicy

LIMIT_FLAGS = (  # (flag, RouterConfig field, help); each default comes from RouterConfig
    (
        "--max-prompt-bytes",
        "max_prompt_bytes",
        "largest prompt in UTF-8 bytes, checked before tokenizing",
    ),
    ("--max-stop-strings", "max_stop_strings", "most stop strings per request"),
    ("--max-stop-string-chars", "max_stop_string_chars", "longest stop string, in characters"),
    ("--max-stop-token-ids", "max_stop_token_ids", "most stop token ids per request"),
    ("--max-logprobs", "max_logprobs", "largest logprobs a request may ask for"),
    ("--max-tenant-chars", "max_tenant_chars", "longest tenant name"),
    ("--max-abs-priority", "max_abs_priority", "priority must be in [-N, N]"),
    ("--max-json-bytes", "max_json_bytes", "largest KServe sampling_parameters JSON"),
    ("--max-json-depth", "max_json_depth", "deepest KServe sampling_parameters JSON"),
    ("--max-message-bytes", "max_message_bytes", "largest gRPC request message"),
    (
        "--max-concurrent-rpcs",
        "max_concurrent_rpcs",
        "RPCs served at once; more are RESOURCE_EXHAUSTED",
    ),
    (
        "--max-stream-requests",
        "max_stream_requests",
        "requests running at once on one KServe ModelStreamInfer stream",
    ),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--scheduler", default="", help="scheduler address HOST:PORT (one pipeline)"
    )
    parser.add_argument(
        "--schedulers",
        default="",
        metavar="A,B,...",
        help="several pipelines' scheduler addresses HOST:PORT, comma-separated "
        "(docs/scale-out.md)",
    )
    parser.add_argument(
        "--redis-url",
        default=None,
        help="Redis the schedulers announce themselves in (--pipeline-id): pipelines, their "
        "load and cached prefixes are discovered there (default: none: only --scheduler(s))",
    )
    parser.add_argument(
        "--routing",
        choices=[p.value for p in RoutingPolicy],
        default=default_of(RouterConfig, "routing"),
        help="how a request's pipeline is picked: longest cached prefix weighed by load, "
        f"least load, or in turn (default: {default_of(RouterConfig, 'routing')})",
    )
    parser.add_argument(
        "--routing-load-weight",
        type=float,
        default=default_of(RouterConfig, "routing_load_weight"),
        help="prefix routing: KV blocks of prefix one queued request is worth "
        f"(default: {default_of(RouterConfig, 'routing_load_weight')})",
    )
    parser.add_argument(
        "--model", required=True, help="Hugging Face model directory (tokenizer and config.json)"
    )
    parser.add_argument(
        "--port", type=int, default=DEFAULT_PORT, help=f"public gRPC port (default: {DEFAULT_PORT})"
    )
    parser.add_argument("--host", default="[::]", help="gRPC bind address (default: [::])")
    parser.add_argument(
        "--served-model-name",
        default=None,
        help="model name clients use (default: the model directory's name)",
    )
    parser.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="context length (default: the model's max_position_embeddings)",
    )
    parser.add_argument(
        "--resume-timeout",
        type=float,
        default=60.0,
        help="seconds a broken scheduler stream keeps trying to resume (default: 60)",
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="serve Prometheus metrics on this port (default: off)",
    )
    parser.add_argument(
        "--otlp-endpoint",
        default=None,
        help="export OpenTelemetry spans: http://HOST:4317, grpc://HOST:PORT or "
        "file:///PATH (JSON lines) (default: off)",
    )
    parser.add_argument(
        "--api-key-file",
        default=default_of(RouterConfig, "api_key_file"),
        metavar="FILE",
        help="API keys (lines of `conveyor keys add`): every call needs `authorization: "
        "Bearer <key>`; the key sets the principal, tenant and priority ceiling "
        "(default: off: everyone is anonymous)",
    )
    add_tls_arguments(
        parser,
        cert_help="PEM certificate of the public port, also the client certificate "
        "presented to the scheduler",
        ca_help="PEM CA the scheduler's certificate must chain to: TLS to the scheduler",
        environ=os.environ,
    )
    parser.add_argument(
        "--tls-client-ca",
        default=default_of(RouterConfig, "tls_client_ca"),
        metavar="PEM",
        help="require client certificates signed by this CA on the public port; without "
        "API keys the certificate's identity is the principal (default: none asked)",
    )
    add_internal_token_argument(parser, "file holding the token presented to the scheduler")
    parser.add_argument(
        "--health-port",
        type=int,
        default=default_of(RouterConfig, "health_port"),
        help="also serve grpc.health.v1 alone, in plaintext, on this port (probes that "
        "cannot speak TLS) (default: off)",
    )
    parser.add_argument(
        "--http-port",
        type=int,
        default=default_of(RouterConfig, "http_port"),
        help="also serve the OpenAI-compatible HTTP API (/v1/completions, "
        "/v1/chat/completions, /v1/models, /health, /version) on this port, with the "
        "same TLS and API keys (default: off)",
    )
    for flag, name, text in LIMIT_FLAGS:
        default = default_of(RouterConfig, name)
        parser.add_argument(
            flag, dest=name, type=int, default=default, help=f"{text} (default: {default})"
        )


def build_config(args: argparse.Namespace) -> RouterConfig:
    return RouterConfig(
        scheduler_address=args.scheduler,
        schedulers=[a.strip() for a in args.schedulers.split(",") if a.strip()],
        redis_url=args.redis_url,
        routing=args.routing,
        routing_load_weight=args.routing_load_weight,
        model_dir=args.model,
        port=args.port,
        host=args.host,
        served_model_name=args.served_model_name,
        max_model_len=args.max_model_len,
        resume_timeout_s=args.resume_timeout,
        metrics_port=args.metrics_port,
        otlp_endpoint=args.otlp_endpoint,
        api_key_file=args.api_key_file,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        tls_ca=args.tls_ca,
        tls_client_ca=args.tls_client_ca,
        internal_token_file=args.internal_token_file,
        internal_token=internal_token(args.internal_token_file, os.environ),
        health_port=args.health_port,
        http_port=args.http_port,
        **{name: getattr(args, name) for _, name, _ in LIMIT_FLAGS},
    )


def run(args: argparse.Namespace) -> int:
    import asyncio

    from services.common.errors import ConfigError, ModelLoadError
    from services.router.server import serve

    config = build_config(args)
    try:
        asyncio.run(serve(config))
    except ModelLoadError as exc:  # the tokenizer: a bad --model, said in one line (exit 2)
        raise ConfigError(f"--model {config.model_dir}: {exc}") from None
    return 0

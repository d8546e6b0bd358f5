"""`conveyor scheduler` flags → `SchedulerConfig`; the service is services/scheduler/server.py."""

from __future__ import annotations

import argparse
import os

from services.common.config import default_of
from services.common.credentials import internal_token
from services.common.security import add_internal_token_argument, add_tls_arguments
from services.scheduler.config import SchedulerConfig, SchedulerPolicy, SchedulingMode

LIMIT_FLAGS = (  # (flag, SchedulerConfig field, help): what a Submit may carry
    ("--max-stop-token-ids", "max_stop_token_ids", "most stop token ids per request"),
    ("--max-logprobs", "max_logprobs", "largest logprobs a request may ask for"),
    ("--max-tenant-chars", "max_tenant_chars", "longest tenant name"),
    ("--max-abs-priority", "max_abs_priority", "priority must be in [-N, N]"),
    ("--max-message-bytes", "max_message_bytes", "largest gRPC request message"),
)


def _default(name: str):
    value = default_of(SchedulerConfig, name)
    return value.value if isinstance(value, SchedulingMode | SchedulerPolicy) else value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--workers",
        required=True,
        help="stage worker addresses in stage order, e.g. w0:50061,w1:50061; with "
        "tensor parallelism every rank, stage-major (stage 0 rank 0, stage 0 rank 1, ...)",
    )
    parser.add_argument(
        "--redis-url",
        default=None,
        help="Redis for request state (default: a private redis-server)",
    )
    parser.add_argument(
        "--port",
        type=int,
        default=_default("port"),
        help=f"gRPC port (default: {_default('port')})",
    )
    parser.add_argument(
        "--host", default=_default("host"), help=f"gRPC bind address (default: {_default('host')})"
    )
    parser.add_argument(
        "--scheduling",
        choices=[m.value for m in SchedulingMode],
        default=_default("scheduling"),
        help="async plans ahead and hands tokens from the last stage to stage 0 "
        f"(default: {_default('scheduling')})",
    )
    parser.add_argument(
        "--speculative-config",
        default=None,
        help='speculative decoding, vLLM\'s JSON: \'{"method": "ngram", '
        '"num_speculative_tokens": 4, "prompt_lookup_max": 4}\' (default: off; '
        "docs/speculative-decoding.md)",
    )
    parser.add_argument(
        "--draft-worker",
        default=None,
        metavar="HOST:PORT",
        help='the draft worker (`conveyor worker --draft`) a {"model": DIR} '
        "--speculative-config asks for proposed tokens (default: none)",
    )
    parser.add_argument(
        "--max-inflight",
        type=int,
        default=None,
        help="steps in flight, fixed (default: stages in sync; in async stages + a lead that "
        "starts at 1 and grows up to the number of stages, while stage 0 waits for plans "
        "the window held back; `conveyor stats`: window, plan wait)",
    )
    parser.add_argument(
        "--scheduler-policy",
        choices=[p.value for p in SchedulerPolicy],
        default=_default("policy"),
        help=f"waiting-queue order (default: {_default('policy')})",
    )
    parser.add_argument(
        "--max-num-seqs",
        type=int,
        default=_default("max_num_seqs"),
        help=f"most requests in one step (default: {_default('max_num_seqs')})",
    )
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="most tokens computed in one step (default: 512 when the stages run on CPU, "
        "2048 on GPU)",
    )
    parser.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="longest sequence (default: the workers' context length)",
    )
    parser.add_argument(
        "--block-size",
        type=int,
        default=None,
        help="must match the workers' (default: taken from the workers)",
    )
    parser.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=_default("enable_prefix_caching"),
        help="reuse KV of identical prompt prefixes (default: on)",
    )
    parser.add_argument(
        "--enable-chunked-prefill",
        action=argparse.BooleanOptionalAction,
        default=_default("enable_chunked_prefill"),
        help="split long prompts across steps (default: on)",
    )
    parser.add_argument(
        "--max-waiting",
        type=int,
        default=_default("max_waiting"),
        help="queue limit; beyond it Submit answers RESOURCE_EXHAUSTED "
        f"(default: {_default('max_waiting')})",
    )
    parser.add_argument(
        "--orphan-timeout",
        type=float,
        default=_default("orphan_timeout_s"),
        help="seconds before a request nobody listens to (its router or client is gone) is "
        f"aborted (default: {_default('orphan_timeout_s')})",
    )
    parser.add_argument(
        "--step-timeout",
        type=float,
        default=_default("step_timeout_s"),
        help="seconds with steps in flight and none finished before a stage counts as hung: "
        "the pipeline is re-formed, and a request whose step times out alone is failed "
        f"(default: {_default('step_timeout_s'):g})",
    )
    parser.add_argument(
        "--store-grace",
        type=float,
        default=_default("store_grace_s"),
        help="seconds of Redis write failures ridden out before health turns NOT_SERVING "
        f"(default: {_default('store_grace_s')})",
    )
    parser.add_argument(
        "--finished-ttl",
        type=int,
        default=_default("finished_ttl_s"),
        help=f"seconds finished requests stay in Redis (default: {_default('finished_ttl_s')})",
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
        "--trace-scheduler",
        default=None,
        metavar="FILE",
        help="append every request state transition and step plan to FILE as JSON lines",
    )
    parser.add_argument(
        "--timeline",
        default=None,
        help="on stop, write a Chrome/Perfetto trace of every stage to FILE",
    )
    add_tls_arguments(
        parser,
        cert_help="PEM certificate served on the gRPC port and presented to the workers",
        ca_help="PEM CA: callers need a client certificate it signed, and the workers' "
        "certificates must chain to it (mutual TLS; needs --tls-cert)",
        environ=os.environ,
    )
    add_internal_token_argument(
        parser, "file holding the token callers must present and the workers are sent"
    )
    parser.add_argument(
        "--health-port",
        type=int,
        default=_default("health_port"),
        help="also serve grpc.health.v1 alone, in plaintext, on this port (probes that "
        "cannot speak TLS) (default: off)",
    )
    parser.add_argument(
        "--pipeline-id",
        default=_default("pipeline_id"),
        help="this pipeline's name among several sharing one Redis: it announces itself to "
        "the routers and adopts a lost pipeline's requests (docs/scale-out.md) "
        "(default: none, a lone pipeline)",
    )
    parser.add_argument(
        "--advertise-address",
        default=None,
        metavar="HOST:PORT",
        help="where routers reach this scheduler, as announced (default: 127.0.0.1:--port)",
    )
    parser.add_argument(
        "--announce-ttl",
        type=float,
        default=_default("announce_ttl_s"),
        help="seconds an announcement lives unless renewed; one that expired marks the "
        f"pipeline lost (default: {_default('announce_ttl_s')})",
    )
    parser.add_argument(
        "--adopt-grace",
        type=float,
        default=_default("adopt_grace_s"),
        help="seconds another pipeline may stay NOT_SERVING before this one adopts its "
        f"requests (default: {_default('adopt_grace_s')})",
    )
    parser.add_argument(
        "--announce-max-blocks",
        type=int,
        default=_default("announce_max_blocks"),
        help="most cached prefix block hashes announced to the routers "
        f"(default: {_default('announce_max_blocks')})",
    )
    for flag, name, text in LIMIT_FLAGS:
        parser.add_argument(
            flag,
            dest=name,
            type=int,
            default=_default(name),
            help=f"{text} (default: {_default(name)})",
        )


def build_config(args: argparse.Namespace) -> SchedulerConfig:
    return SchedulerConfig(
        workers=[a.strip() for a in args.workers.split(",") if a.strip()],
        redis_url=args.redis_url,
        host=args.host,
        port=args.port,
        scheduling=args.scheduling,
        speculative=args.speculative_config,
        draft_worker=args.draft_worker,
        max_inflight=args.max_inflight,
        policy=args.scheduler_policy,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        block_size=args.block_size,
        enable_prefix_caching=args.enable_prefix_caching,
        enable_chunked_prefill=args.enable_chunked_prefill,
        max_waiting=args.max_waiting,
        finished_ttl_s=args.finished_ttl,
        orphan_timeout_s=args.orphan_timeout,
        step_timeout_s=args.step_timeout,
        store_grace_s=args.store_grace,
        metrics_port=args.metrics_port,
        otlp_endpoint=args.otlp_endpoint,
        trace_scheduler=args.trace_scheduler,
        timeline=args.timeline,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        tls_ca=args.tls_ca,
        internal_token_file=args.internal_token_file,
        internal_token=internal_token(args.internal_token_file, os.environ),
        health_port=args.health_port,
        pipeline_id=args.pipeline_id,
        advertise_address=args.advertise_address,
        announce_ttl_s=args.announce_ttl,
        adopt_grace_s=args.adopt_grace,
        announce_max_blocks=args.announce_max_blocks,
        **{name: getattr(args, name) for _, name, _ in LIMIT_FLAGS},
    )


def run(args: argparse.Namespace) -> int:
    import asyncio

    from services.common.config import check_output_file
    from services.common.errors import ConfigError
    from services.scheduler.server import serve

    config = build_config(args)
    if not config.workers:
        raise ConfigError("--workers lists no address: give each stage worker's HOST:PORT")
    # written as it runs and as it stops: refused now rather than lost then
    if config.trace_scheduler:
        check_output_file(config.trace_scheduler, "--trace-scheduler")
    if config.timeline:
        check_output_file(config.timeline, "--timeline")
    return asyncio.run(serve(config))

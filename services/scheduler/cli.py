"""`conveyor scheduler` flags; the service itself is in services/scheduler/server.py."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--workers",
        required=True,
        help="stage worker addresses in stage order, e.g. w0:50061,w1:50061",
    )
    parser.add_argument(
        "--redis-url",
        default=None,
        help="Redis for request state (default: a private redis-server)",
    )
    parser.add_argument("--port", type=int, default=50060, help="gRPC port (default: 50060)")
    parser.add_argument("--host", default="[::]", help="gRPC bind address (default: [::])")
    parser.add_argument(
        "--scheduling",
        choices=["async", "sync"],
        default="async",
        help="async plans ahead and hands tokens from the last stage to stage 0",
    )
    parser.add_argument(
        "--max-inflight",
        type=int,
        default=None,
        help="steps in flight (default: 2 x stages in async, stages in sync)",
    )
    parser.add_argument(
        "--scheduler-policy",
        choices=["fcfs", "priority", "fair"],
        default="fcfs",
        help="waiting-queue order (default: fcfs)",
    )
    parser.add_argument(
        "--max-num-seqs", type=int, default=256, help="most requests in one step (default: 256)"
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
        default=True,
        help="reuse KV of identical prompt prefixes (default: on)",
    )
    parser.add_argument(
        "--enable-chunked-prefill",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="split long prompts across steps (default: on)",
    )
    parser.add_argument(
        "--max-waiting",
        type=int,
        default=10_000,
        help="queue limit; beyond it Submit answers RESOURCE_EXHAUSTED",
    )
    parser.add_argument(
        "--finished-ttl",
        type=int,
        default=3600,
        help="seconds finished requests stay in Redis (default: 3600)",
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


def run(args: argparse.Namespace) -> int:
    import asyncio

    from services.scheduler.server import serve
    from services.scheduler.service import ServiceOptions

    options = ServiceOptions(
        scheduling=args.scheduling,
        max_inflight=args.max_inflight,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        enable_prefix_caching=args.enable_prefix_caching,
        enable_chunked_prefill=args.enable_chunked_prefill,
        policy=args.scheduler_policy,
        max_waiting=args.max_waiting,
        block_size=args.block_size,
    )
    asyncio.run(serve(args, options))
    return 0

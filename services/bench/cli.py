"""`conveyor bench`: benchmark a running stack, or `--compare` scheduling modes end to end.

    conveyor bench --server localhost:50051 --scheduler localhost:50052 \\
        --num-prompts 64 --input-len 128 --output-len 128 --request-rate inf --json out.json
    conveyor bench --compare [--num-prompts 16 --input-len 32 --output-len 32]
    conveyor bench --backend openai --server localhost:8000   # the OpenAI-compatible API
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
from pathlib import Path

from services.common.config import at_least, checked
from services.common.credentials import internal_token
from services.common.security import (
    ENV_API_KEY,
    ClientSecurity,
    add_internal_token_argument,
    add_tls_arguments,
)

logger = logging.getLogger(__name__)

positive_float = checked(float, lambda x: x > 0, "> 0")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from services.bench.run import DATASETS

    parser.add_argument(
        "--server",
        default=None,
        help="router address (default: localhost:50051; with --backend openai the HTTP "
        "API's, localhost:8000)",
    )
    parser.add_argument(
        "--backend",
        choices=("grpc", "openai"),
        default="grpc",
        help="grpc: conveyor.v1.Generation; openai: the router's OpenAI-compatible HTTP API "
        "(streamed /v1/completions with the openai client) (default: grpc)",
    )
    parser.add_argument(
        "--scheduler",
        default=None,
        help="scheduler address, for bubble per stage, prefix-cache hit rate "
        "and preemptions (optional)",
    )
    parser.add_argument(
        "--dataset",
        choices=DATASETS,
        default="random",
        help="random token prompts, prompts sharing prefixes, or prompts asking to repeat "
        "a text (outputs copy the prompt: speculative decoding) (default: random)",
    )
    # None: the workload's default (--compare --device sim: each workload's own)
    parser.add_argument(
        "--num-prompts", type=at_least(1), default=None, help="requests (default: 64)"
    )
    parser.add_argument(
        "--input-len",
        type=at_least(1),
        default=None,
        help="prompt tokens (prefix dataset: after the prefix) (default: 128)",
    )
    parser.add_argument(
        "--output-len",
        type=at_least(1),
        default=None,
        help="output tokens per request (default: 128)",
    )
    parser.add_argument(
        "--range-ratio",
        type=checked(float, lambda r: 0 <= r < 1, "in [0, 1)"),
        default=0.0,
        help="lengths vary uniformly within ±ratio of --input-len/--output-len, "
        "a ratio in [0, 1) (default: 0)",
    )
    parser.add_argument(
        "--prefix-len",
        type=at_least(1),
        default=64,
        help="prefix dataset: shared prefix tokens (default: 64)",
    )
    parser.add_argument(
        "--num-prefixes",
        type=at_least(1),
        default=1,
        help="prefix dataset: distinct prefixes, used in turn (default: 1)",
    )
    parser.add_argument(
        "--request-rate",
        type=positive_float,
        default=float("inf"),
        help="requests per second, Poisson arrivals; inf sends all at once (default: inf)",
    )
    parser.add_argument(
        "--max-concurrency",
        type=at_least(1),
        default=None,
        help="at most this many requests in flight (default: no limit)",
    )
    parser.add_argument(
        "--release-at-once",
        action="store_true",
        help="hold the burst in the scheduler's queue (Pause) until every request is there, "
        "then release it (Unpause): the run and each request's times count from the release, "
        "so the client's sending speed does not shape the burst. Needs --scheduler with its "
        "admin access, one pipeline, and no --request-rate (default: off)",
    )
    parser.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="generate exactly --output-len tokens (default: on)",
    )
    parser.add_argument(
        "--seed", type=at_least(0), default=0, help="workload and arrivals seed (default: 0)"
    )
    parser.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="sampling temperature of every request (default: 0, greedy)",
    )
    parser.add_argument(
        "--timeout",
        type=positive_float,
        default=None,
        help="per-request deadline in seconds (default: none)",
    )
    parser.add_argument(
        "--json", dest="json_path", default=None, help="also write the result as JSON to FILE"
    )
    parser.add_argument(
        "--no-progress", dest="progress", action="store_false", help="no progress bar"
    )
    add_tls_arguments(
        parser,
        cert_help="client certificate, presented to the router and the scheduler",
        ca_help=f"PEM CA the router's and the scheduler's certificates chain to: TLS on. The "
        f"router's API key comes from env {ENV_API_KEY}",
        environ=os.environ,
    )
    add_internal_token_argument(parser, "file holding the scheduler's internal token (--scheduler)")
    compare = parser.add_argument_group("--compare: start stacks on this machine and compare")
    compare.add_argument(
        "--compare",
        action="store_true",
        help="2 stages sync, 2 stages async, 1 stage and transformers static "
        "batching on one workload; writes bench/results/",
    )
    compare.add_argument(
        "--compare-routing",
        action="store_true",
        help="round-robin, least-load and prefix routing over 2 pipelines, and 1 pipeline, "
        "on one workload: throughput, TTFT, prefix-cache hit rate (docs/scale-out.md)",
    )
    compare.add_argument(
        "--kv-cache-memory",
        default="1GiB",
        help="--compare-routing: KV cache per pipeline, e.g. 32MiB (default: 1GiB)",
    )
    compare.add_argument(
        "--max-model-len",
        type=at_least(1),
        default=None,
        help="--compare-routing: the stacks' context length, to fit a small "
        "--kv-cache-memory (default: the model's)",
    )
    compare.add_argument(
        "--threads-per-worker",
        type=at_least(1),
        default=1,
        help="--compare-routing: threads of each pipeline's worker (default: 1)",
    )
    compare.add_argument(
        "--model", default=None, help="model directory (default: SmolLM2-135M, fetched once)"
    )
    compare.add_argument(
        "--results-dir",
        default="bench/results",
        help="where --compare writes JSON, traces and PNGs (default: bench/results)",
    )
    compare.add_argument(
        "--skip-hf", action="store_true", help="leave out the transformers baseline"
    )
    compare.add_argument(
        "--speculative-config",
        default=None,
        help="with --compare: 2 stages async without and with this speculative decoding "
        "config (JSON, as conveyor up's), instead of the scheduling modes",
    )
    compare.add_argument(
        "--peers",
        default=None,
        help="compare with these CPU engines instead of transformers: vllm,openvino (each "
        "built in its own virtualenv under --peers-dir on first use); conveyor-vllm-bench "
        "adds Conveyor's HTTP endpoint measured by `vllm bench serve`; with "
        "--speculative-config: vllm-ngram (vLLM without and with the same n-gram config)",
    )
    compare.add_argument(
        "--rounds",
        type=at_least(1),
        default=1,
        help="--peers: run every system this many times, alternating; medians. --device sim "
        "--sweep: run each point's sync and async this many times, alternating; the median "
        "run of each (default: 1)",
    )
    compare.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default="float32",
        help="--peers and --speculative-config: the dtype of Conveyor's stacks and of the "
        "peers (default: float32)",
    )
    compare.add_argument(
        "--peers-dir",
        default=None,
        help="--peers: where the peers' virtualenvs live "
        "(default: $CONVEYOR_PEERS_DIR or ~/.cache/conveyor/peers)",
    )
    # --compare --device sim: services/bench/sim_experiment.py
    group = parser.add_argument_group("--compare --device sim")
    group.add_argument(
        "--device",
        choices=["cpu", "sim"],
        default="cpu",
        help="--compare on real CPU stages (default) or on simulated devices (sim)",
    )
    group.add_argument(
        "--sim-profile",
        default=None,
        help="sim: modeled hardware (default: h200; cpu with --calibration)",
    )
    group.add_argument(
        "--stages-list",
        default="2,4,8",
        help="sim: pipeline depths to compare, e.g. 2,4,8 (default: 2,4,8)",
    )
    group.add_argument(
        "--workloads",
        default="short,long",
        help="sim: short (256 x 128/128) and/or long (64 x 2048/512) (default: both)",
    )
    group.add_argument(
        "--arrivals",
        default="burst,poisson",
        help="sim: burst (all at once) and/or poisson (0.9 x burst req/s) (default: both)",
    )
    group.add_argument(
        "--sweep",
        action="store_true",
        help="sim: sweep the modeled stage step time from ~20 ms to ~0.5 ms instead",
    )
    group.add_argument(
        "--calibration",
        action="store_true",
        help="sim: instead, the real SmolLM2 stacks (2 stages of 1 thread, 1 stage of 2) "
        "against the same stacks simulated on --sim-profile (default: cpu), predicted "
        "against measured; --rounds alternates them",
    )


def _workload(args: argparse.Namespace):
    from services.bench.run import Workload

    sizes = {
        name: getattr(args, name)
        for name in ("num_prompts", "input_len", "output_len")
        if getattr(args, name) is not None  # not given: the Workload's default
    }
    return Workload(
        dataset=args.dataset,
        **sizes,
        range_ratio=args.range_ratio,
        prefix_len=args.prefix_len,
        num_prefixes=args.num_prefixes,
        seed=args.seed,
    )


def _check_peer_flags(args: argparse.Namespace) -> None:
    with_peers = args.compare and args.peers and not args.speculative_config
    with_spec = args.compare and args.speculative_config
    with_rounds = args.compare and args.device == "sim" and (args.calibration or args.sweep)
    if args.rounds != 1 and not (with_peers or with_rounds):
        raise SystemExit(
            "--rounds, --dtype and --peers-dir go with --compare --peers (--rounds also "
            "with --compare --device sim --calibration or --sweep)"
        )
    if (args.dtype != "float32" or args.peers_dir) and not (with_peers or with_spec):
        raise SystemExit(
            "--rounds, --dtype and --peers-dir go with --compare --peers (--dtype and "
            "--peers-dir also with --compare --speculative-config)"
        )
    if "vllm-ngram" in (args.peers or "").split(",") and not with_spec:
        raise SystemExit(
            "--peers vllm-ngram goes with --compare --speculative-config JSON (e.g. "
            "--dataset repeat): vLLM without and with the same n-gram speculation"
        )
    if with_spec and args.peers:
        from services.bench.spec_compare import parse_spec_peers

        try:
            parse_spec_peers(args.peers)
        except ValueError as exc:
            raise SystemExit(str(exc)) from None
    if args.peers and args.device != "cpu":
        raise SystemExit("--peers runs on the CPU: leave out --device sim")
    if args.calibration and not (args.compare and args.device == "sim"):
        raise SystemExit("--calibration goes with --compare --device sim")
    if args.release_at_once and args.compare:
        raise SystemExit(
            "--release-at-once is for one run against a stack; --compare --device sim holds "
            "its bursts this way always, the other comparisons send them as the peers are sent"
        )


def run(args: argparse.Namespace) -> int:
    from services.bench.driver import DriverOptions

    _check_peer_flags(args)
    options = DriverOptions(
        request_rate=args.request_rate,
        max_concurrency=args.max_concurrency,
        ignore_eos=args.ignore_eos,
        timeout_s=args.timeout,
        progress=args.progress,
        security=ClientSecurity.from_files(
            args.tls_ca, args.tls_cert, args.tls_key, os.environ.get(ENV_API_KEY) or None
        ),
        backend=args.backend,
        temperature=args.temperature,
    )
    if args.compare and args.device == "sim":
        from services.bench.sim_experiment import run_sim_compare

        return run_sim_compare(args)
    if args.compare and args.speculative_config:
        from services.bench.spec_compare import run_spec_compare

        return run_spec_compare(args, _workload(args), options)
    if args.compare and args.peers:
        from services.bench.peer_compare import run_peer_compare

        return run_peer_compare(args, _workload(args), options)
    if args.compare_routing:
        from services.bench.routing_compare import run_routing_compare

        return run_routing_compare(args, _workload(args), options)
    if args.compare:
        from services.bench.compare import run_compare

        return run_compare(args, _workload(args), options)
    return asyncio.run(_bench(args, options))


async def _bench(args: argparse.Namespace, options) -> int:
    from services.bench.report import result_table
    from services.bench.run import BenchTarget, build_requests, run_benchmark

    workload = _workload(args)
    server = args.server or ("localhost:8000" if args.backend == "openai" else "localhost:50051")
    token = internal_token(args.internal_token_file, os.environ)
    scheduler_security = ClientSecurity.from_files(args.tls_ca, args.tls_cert, args.tls_key, token)
    target = BenchTarget(server, args.scheduler, options, scheduler_security, args.release_at_once)
    requests = await build_requests(server, workload, options.security, args.backend)
    result = await run_benchmark(target, requests, seed=args.seed)
    print(result_table(result), flush=True)
    if args.json_path:
        path = Path(args.json_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2) + "\n")
        logger.info("wrote %s", path)
    return 0 if result["failed"] == 0 else 1

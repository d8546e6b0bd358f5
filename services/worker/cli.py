"""`conveyor worker` flags → `WorkerConfig`; the service is services/worker/server.py."""

from __future__ import annotations

import argparse
import os


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from services.common.config import default_of
    from services.common.security import add_internal_token_argument, add_tls_arguments
    from services.worker.config import DEVICES, PROJECTIONS, QUANTIZATIONS, WorkerConfig

    def default(name: str):
        return default_of(WorkerConfig, name)

    parser.add_argument("--model", required=True, help="Hugging Face model directory")
    parser.add_argument("--stage", type=int, default=0, help="this worker's stage, 0-based")
    parser.add_argument(
        "--stages",
        "--pipeline-parallel-size",
        dest="stages",
        type=int,
        default=default("num_stages"),
        help=f"stages in the pipeline (default: {default('num_stages')})",
    )
    parser.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=default("tensor_parallel_size"),
        help="tensor-parallel ranks per stage, one worker process each "
        f"(default: {default('tensor_parallel_size')})",
    )
    parser.add_argument(
        "--tp-rank",
        type=int,
        default=default("tp_rank"),
        help="this worker's tensor-parallel rank inside its stage, 0-based "
        f"(default: {default('tp_rank')})",
    )
    parser.add_argument(
        "--dist-addr",
        default=default("dist_addr"),
        help="torch.distributed rendezvous HOST:PORT, hosted by stage 0 (tp rank 0) "
        f"(default: {default('dist_addr')})",
    )
    parser.add_argument(
        "--port", type=int, default=default("port"), help=f"gRPC port (default: {default('port')})"
    )
    parser.add_argument(
        "--host", default=default("host"), help=f"gRPC bind address (default: {default('host')})"
    )
    parser.add_argument(
        "--device",
        choices=list(DEVICES),
        default=default("device"),
        help="cpu, cuda, or sim: a simulated device that models the forward pass "
        f"(docs/simulation.md) (default: {default('device')})",
    )
    parser.add_argument(
        "--dtype", choices=["float32", "bfloat16", "float16"], default=default("dtype")
    )
    parser.add_argument(
        "--quantization",
        choices=list(QUANTIZATIONS),
        default=None,
        help="weight-only quantization of the decoder layers' linears, per output channel, "
        "at load (default: the checkpoint's own; FP8 checkpoints stay fp8)",
    )
    parser.add_argument(
        "--quantization-ignore",
        default=None,
        metavar="PROJ[,PROJ]",
        help=f"decoder projections kept in --dtype ({', '.join(PROJECTIONS)}), or none "
        "(default: down_proj for fp8, none for int8 and FP8 checkpoints)",
    )
    parser.add_argument(
        "--kv-cache-memory",
        default=default("kv_cache_memory"),
        help=f"this stage's KV cache budget, e.g. 512MiB (default: {default('kv_cache_memory')})",
    )
    parser.add_argument(
        "--block-size", type=int, default=default("block_size"), choices=[8, 16, 32]
    )
    parser.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="longest sequence (default: the model's context length)",
    )
    parser.add_argument("--layer-split", default=None, help="layers per stage, e.g. 15,15")
    parser.add_argument(
        "--attention-backend",
        choices=["cpu", "torch", "triton"],
        default=None,
        help="default: triton on cuda; on cpu the C++ decode kernel (cpu), or "
        "plain torch when it cannot be compiled here",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch intra-op threads (default: under a CPU limit, a container's cgroup quota, its "
        "whole CPUs; else this process's cores / (stages x tp ranks); at least 1)",
    )
    parser.add_argument(
        "--linear-backend",
        choices=["auto", "onednn", "torch"],
        default=default("linear_backend"),
        help="matmul kernels: onednn (weights packed once; 2-2.5x faster than "
        "torch's MKL path on CPUs with AVX-512) or torch; auto = onednn "
        "on CPU, plus the C++ kernels of model/cpu_ops.py for decode steps of "
        "1-4 rows and fused elementwise ops (default: auto)",
    )
    parser.add_argument(
        "--cpu-affinity",
        default=None,
        metavar="CPUS",
        help="pin this worker to these cores, e.g. 0 or 0-3,8 (default: not "
        "pinned; `conveyor up` pins each stage to its own cores)",
    )
    parser.add_argument("--seed", type=int, default=None, help="seed of unseeded random sampling")
    parser.add_argument(
        "--record-plans",
        default=None,
        metavar="FILE",
        help="write every plan this stage receives (the prompts' token ids among them) to "
        "FILE, to run them again alone with `python -m services.bench.replay_plans FILE` "
        "(default: off)",
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
    add_tls_arguments(
        parser,
        cert_help="PEM certificate served on the gRPC port",
        ca_help="PEM CA: callers need a client certificate it signed (mutual TLS; needs "
        "--tls-cert)",
        environ=os.environ,
    )
    add_internal_token_argument(
        parser, "file holding the token callers must present; it also signs the rendezvous"
    )
    parser.add_argument(
        "--health-port",
        type=int,
        default=default("health_port"),
        help="also serve grpc.health.v1 alone, in plaintext, on this port (probes that "
        "cannot speak TLS) (default: off)",
    )
    parser.add_argument(
        "--hang-timeout",
        type=float,
        default=default("hang_timeout_s"),
        metavar="SECONDS",
        help="exit (code 70) when one step has computed longer than this, so that the "
        "supervisor (conveyor up, compose, Kubernetes) starts a fresh worker: a wedged kernel "
        "or collective never returns; 0: never (default: %(default)s)",
    )
    parser.add_argument(
        "--draft",
        action="store_true",
        help="serve the whole model as the draft worker of speculative decoding, which the "
        "scheduler asks for proposed tokens (docs/speculative-decoding.md) (default: a "
        "pipeline stage)",
    )
    add_sim_arguments(parser)


def add_sim_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `--device sim` (shared with `conveyor up`)."""
    from services.common.config import default_of
    from services.worker.config import WorkerConfig

    def default(name: str):
        return default_of(WorkerConfig, name)

    parser.add_argument(
        "--sim-profile",
        default=default("sim_profile"),
        metavar="NAME|FILE",
        help="device sim: modeled hardware, h100, h200, a100, cpu (this machine, fitted) or a "
        f"profile JSON file (default: {default('sim_profile')})",
    )
    parser.add_argument(
        "--sim-link-bandwidth",
        type=float,
        default=default("sim_link_bandwidth"),
        metavar="GB_PER_S",
        help="device sim: stage-to-stage bandwidth in GB/s (default: the profile's)",
    )
    parser.add_argument(
        "--sim-link-latency",
        type=float,
        default=default("sim_link_latency"),
        metavar="US",
        help="device sim: stage-to-stage latency in microseconds (default: the profile's)",
    )
    parser.add_argument(
        "--sim-tensor-parallel-size",
        type=int,
        default=default("sim_tensor_parallel_size"),
        help="device sim: modeled tensor-parallel ranks per stage "
        f"(default: {default('sim_tensor_parallel_size')})",
    )


def build_config(args: argparse.Namespace):
    from services.common.affinity import parse_cpu_list
    from services.common.credentials import internal_token
    from services.worker.config import WorkerConfig, parse_layer_split, parse_projections

    return WorkerConfig(
        model_dir=args.model,
        stage_index=args.stage,
        num_stages=args.stages,
        tp_rank=args.tp_rank,
        tensor_parallel_size=args.tensor_parallel_size,
        layer_split=parse_layer_split(args.layer_split),
        block_size=args.block_size,
        kv_cache_memory=args.kv_cache_memory,
        max_model_len=args.max_model_len,
        dtype=args.dtype,
        quantization=args.quantization,
        quantization_ignore=parse_projections(args.quantization_ignore),
        attention_backend=args.attention_backend,
        device=args.device,
        num_threads=args.threads,
        linear_backend=args.linear_backend,
        host=args.host,
        port=args.port,
        dist_addr=args.dist_addr,
        cpu_affinity=parse_cpu_list(args.cpu_affinity) if args.cpu_affinity else None,
        seed=args.seed,
        metrics_port=args.metrics_port,
        otlp_endpoint=args.otlp_endpoint,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        tls_ca=args.tls_ca,
        internal_token_file=args.internal_token_file,
        internal_token=internal_token(args.internal_token_file, os.environ),
        health_port=args.health_port,
        sim_profile=args.sim_profile,
        sim_link_bandwidth=args.sim_link_bandwidth,
        sim_link_latency=args.sim_link_latency,
        sim_tensor_parallel_size=args.sim_tensor_parallel_size,
        is_draft=args.draft,
        record_plans=args.record_plans,
        hang_timeout_s=args.hang_timeout,
    )


def run(args: argparse.Namespace) -> int:
    import asyncio
    import logging
    import sys

    from services.common.affinity import pin_process
    from services.worker.engine import session_threads_alive

    config = build_config(args)
    if config.is_draft:
        from services.worker.draft_server import serve
    else:
        from services.worker.server import serve
    if config.cpu_affinity:
        pin_process(config.cpu_affinity)
    # The compute thread hands each result to the gRPC loop thread; with Python's default
    # 5 ms GIL switch interval that handoff cost the last stage 1.1-1.6 ms per step on the
    # critical path, with 0.5 ms about 0.7 ms (2-core CPU, 32-request decode steps).
    sys.setswitchinterval(0.0005)
    asyncio.run(serve(config))
    if session_threads_alive():
        # A session thread still inside torch.distributed (a peer wait, or a rendezvous the
        # stopping stages never finished) would have its C++ objects destroyed under it at
        # the interpreter's exit, which can abort the process ("terminate called without an
        # active exception", exit -6): leave now, without running those destructors.
        logging.getLogger(__name__).info(
            "stage %d: exiting at once: an ended session's thread is still inside "
            "torch.distributed",
            config.stage_index,
        )
        logging.shutdown()
        sys.stdout.flush()
        os._exit(0)
    return 0

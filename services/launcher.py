"""`conveyor up`: the whole stack on one machine, as child processes.

Starts a private redis-server (unless --redis-url), P stage workers, the scheduler and the
router, waits until the router reports SERVING, and on Ctrl-C / SIGTERM stops all of them.
Children die with the launcher even if it is killed (PR_SET_PDEATHSIG), so no process is
left behind.

The workers, the scheduler and the rendezvous listen on 127.0.0.1 only, the router too unless
--host says otherwise. Without credentials (the default) the stack is unauthenticated, and
says so; --api-key-file, --tls-cert/--tls-key/--tls-ca and --internal-token-file (or
CONVEYOR_INTERNAL_TOKEN, inherited by the children) are passed to the services they concern.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from services.common.affinity import cpu_budget, stage_cpus
from services.common.config import (
    MAX_PORT,
    at_least,
    check_output_dir,
    check_output_file,
    checked,
    default_of,
    port_number,
)
from services.common.credentials import check_tls_files, internal_token
from services.common.errors import ConfigError, ModelLoadError
from services.common.process import child_env
from services.common.redis_server import RedisServer, free_port, reserve_ports
from services.common.redis_url import check_redis_url, redacted
from services.common.security import ClientSecurity, add_internal_token_argument, add_tls_arguments
from services.router.config import DEFAULT_HTTP_PORT
from services.worker.cli import add_sim_arguments
from services.worker.config import DEVICES, QUANTIZATIONS, WorkerConfig, check_no_sim_flags

logger = logging.getLogger(__name__)


class StackStopped(Exception):
    """A stop (SIGTERM / Ctrl-C) arrived while the stack was still starting."""


INTERNAL_HOST = "127.0.0.1"
"""Where `conveyor up` binds the workers, the scheduler and the rendezvous."""


def wait_serving(
    address: str,
    timeout_s: float,
    proc: subprocess.Popen | None = None,
    should_stop: Callable[[], bool] | None = None,
    security: ClientSecurity | None = None,
) -> None:
    """Polls grpc.health.v1 until SERVING (over TLS with `security`'s CA; health needs no
    other credential); raises TimeoutError naming the address, or StackStopped as soon as
    `should_stop()` is true.

    A fresh channel per poll: a channel whose first connects failed (the server was still
    starting) backs off for seconds and would see SERVING late."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + timeout_s
    security = security or ClientSecurity()
    while time.monotonic() < deadline:
        if should_stop is not None and should_stop():
            raise StackStopped(f"stopped while waiting for {address}")
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the process serving {address} exited with {proc.returncode}")
        with security.sync_channel(address) as channel:
            try:
                stub = health_pb2_grpc.HealthStub(channel)
                reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
        time.sleep(0.1)
    raise TimeoutError(f"{address} did not become SERVING within {timeout_s:.0f} s")


RESTART_BACKOFF_S = (1.0, 30.0)
"""First and longest wait before a dead child is started again."""
CONFIG_ERROR_EXIT = 2
"""What `conveyor` exits with on a bad flag or value (argparse and ConfigError alike)."""
RESTART_WINDOW_S = 300.0
"""--max-restarts counts the restarts of one child within this many seconds."""


class StackFailed(Exception):
    """A child died more often than --max-restarts allows: the stack gives up."""


@dataclass
class Child:
    """One supervised child process and how to start it again."""

    name: str
    argv: list[str]
    env: dict[str, str] | None
    proc: subprocess.Popen
    restarts: list[float] = field(default_factory=list)
    """When it was restarted (monotonic s), within the last RESTART_WINDOW_S."""
    restart_at: float | None = None
    """When it is due to start again, once it was found dead."""


@dataclass
class Stack:
    """The child processes of one `conveyor up`, stopped in reverse start order.

    `supervise()` restarts a child that died (worker, scheduler, router, the private Redis)
    after a backoff, so the pipeline heals as it would under compose `restart:` or
    Kubernetes: a dead worker or scheduler is recovered by the scheduler and the routers
    (requests are recomputed, streams resumed), a dead private Redis comes back empty and is
    rewritten by the scheduler. More than `max_restarts` restarts of one child within
    RESTART_WINDOW_S stops the stack.
    """

    children: list[Child] = field(default_factory=list)
    redis: RedisServer | None = None
    redis_restarts: list[float] = field(default_factory=list)
    redis_restart_at: float | None = None
    scheduler_address: str | None = None
    """Where `conveyor stats` and `conveyor bench --scheduler` reach the (first) scheduler."""
    scheduler_addresses: list[str] = field(default_factory=list)
    """Every pipeline's scheduler (`--pipelines`)."""
    stopping: bool = False
    """Set by the launcher's signal handler; start-up gives up at its next wait."""
    max_restarts: int = 5

    def spawn(
        self, name: str, argv: list[str], env: dict[str, str] | None = None
    ) -> subprocess.Popen:
        logger.info("starting %s: %s", name, redacted(" ".join(argv)))
        child = Child(name, argv, env, _popen(argv, env))
        self.children.append(child)
        return child.proc

    def supervise(self) -> None:
        """Starts again, after a backoff, every child found dead; raises StackFailed when one
        died more than `max_restarts` times within RESTART_WINDOW_S."""
        now = time.monotonic()
        for child in self.children:
            code = child.proc.poll()
            if code is None:
                continue
            if child.restart_at is None:
                child.restart_at = self._restart_time(child.name, code, child.restarts, now)
            elif now >= child.restart_at:
                logger.warning("restarting %s", child.name)
                child.proc = _popen(child.argv, child.env)
                child.restarts.append(now)
                child.restart_at = None
        if self.redis is not None and self.redis.proc.poll() is not None:
            if self.redis_restart_at is None:
                code = self.redis.proc.returncode
                self.redis_restart_at = self._restart_time("redis", code, self.redis_restarts, now)
            elif now >= self.redis_restart_at:
                logger.warning("restarting the private redis-server (it comes back empty)")
                self.redis.start()
                self.redis_restarts.append(now)
                self.redis_restart_at = None

    def _restart_time(self, name: str, code: int, restarts: list[float], now: float) -> float:
        if code == CONFIG_ERROR_EXIT:  # a bad flag or value: no restart will fix it
            raise StackFailed(f"{name} refused its configuration (exit code {code}; see above)")
        restarts[:] = [t for t in restarts if now - t < RESTART_WINDOW_S]
        if len(restarts) >= self.max_restarts:
            raise StackFailed(
                f"{name} exited with code {code} after {len(restarts)} restarts within "
                f"{RESTART_WINDOW_S:.0f} s (--max-restarts {self.max_restarts}): giving up"
            )
        delay = min(RESTART_BACKOFF_S[0] * 2 ** len(restarts), RESTART_BACKOFF_S[1])
        logger.error("%s exited with code %s; restarting it in %.0f s", name, code, delay)
        return now + delay

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM in reverse start order: the router, then the scheduler (waited for: it
        reads the workers' timelines as it stops), then every worker at once. Each wave has
        `grace_s` of its own: a router slow to drain does not shorten the scheduler's."""
        children = list(reversed(self.children))
        workers = [c for c in children if c.name.startswith("worker")]
        waves = [[c] for c in children if c not in workers] + [workers]
        for wave in waves:
            deadline = time.monotonic() + grace_s
            for child in wave:
                if child.proc.poll() is None:
                    child.proc.send_signal(signal.SIGTERM)
            for child in wave:
                try:
                    child.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    logger.warning("%s did not stop within %.0f s; killing it", child.name, grace_s)
                    child.proc.kill()
                    child.proc.wait()
                else:
                    if child.proc.returncode:  # a crash as it stopped (not our kill above)
                        logger.warning(
                            "%s exited with code %s as it stopped",
                            child.name,
                            child.proc.returncode,
                        )
        self.children.clear()
        if self.redis:
            self.redis.stop()
            self.redis = None


def _popen(argv: list[str], env: dict[str, str] | None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "services.cli", *argv], env=child_env(env))


def start_stack(args: argparse.Namespace, stack: Stack | None = None) -> tuple[Stack, str]:
    """Starts every service; returns the stack and the address clients should use.

    Raises StackStopped (with every child stopped) when `stack.stopping` is set meanwhile."""
    stack = stack or Stack(max_restarts=args.max_restarts)

    def should_stop() -> bool:
        stack.supervise()  # a child that dies while the stack starts is started again too
        return stack.stopping

    internal, public = _security_args(args)
    client = _client_security(args)
    reserve_ports(_named_ports(args))
    try:
        # the arguments first: a refused one starts nothing, not even Redis
        num_pipelines = getattr(args, "pipelines", 1)
        check_model(args)
        check_ports(args)
        tp_size = check_parallel(args)
        check_draft_model(args)
        check_outputs(args)
        if args.device != "sim":  # the workers would not see them
            check_no_sim_flags(args, args.device)
        redis_url = args.redis_url
        if not redis_url:
            stack.redis = RedisServer().start()
            redis_url = stack.redis.url
        env = dict(os.environ)
        num_ranks = args.stages * tp_size
        # every worker it starts shares this process's cores and quota
        threads = args.threads or max(1, cpu_budget() // (num_ranks * num_pipelines))
        pinned = None
        if args.cpu_affinity == "auto":
            pinned = stage_cpus(num_ranks * num_pipelines, threads)
        for index in range(num_pipelines):
            cpus = pinned[index * num_ranks : (index + 1) * num_ranks] if pinned else None
            _spawn_pipeline(stack, args, index, num_pipelines, redis_url, internal, env, cpus)
        for scheduler_addr in stack.scheduler_addresses:
            wait_serving(scheduler_addr, args.startup_timeout, None, should_stop, client)
        if num_pipelines == 1:
            upstream = ["--scheduler", stack.scheduler_address]
        else:
            upstream = ["--schedulers", ",".join(stack.scheduler_addresses)]
            upstream += ["--redis-url", redis_url]
        argv = [
            "router",
            *upstream,
            "--model",
            args.model,
            "--port",
            str(args.port),
            "--host",
            args.host,
            *public,
            *_observability_args(args, 0),
            *_http_args(args),
        ]
        if getattr(args, "max_model_len", None) is not None:
            # The router checks prompts and max_tokens against it and advertises it.
            argv += ["--max-model-len", str(args.max_model_len)]
        argv += args.router_args
        stack.spawn("router", argv, env)
        public_addr = f"{_connect_host(args.host)}:{args.port}"
        wait_serving(public_addr, args.startup_timeout, None, should_stop, client)
        return stack, public_addr
    except BaseException:
        stack.stop()
        raise


def check_model(args: argparse.Namespace) -> None:
    """--model must load as a model directory before any child starts: a worker that cannot
    load it dies, and would be restarted --max-restarts times before the stack gives up."""
    from services.models.fetch import KNOWN_MODELS
    from services.worker.model.config import ModelConfig

    try:
        ModelConfig.from_dir(args.model)
    except ModelLoadError as exc:
        hint = ""
        if args.model in KNOWN_MODELS:
            hint = f" (`conveyor models fetch {args.model}` downloads it and prints its directory)"
        raise ConfigError(f"--model {args.model}: {exc}{hint}") from None


def check_outputs(args: argparse.Namespace) -> None:
    """--redis-url, and the files and folders the children write: a child refuses a bad one
    with exit 2 as it starts, or loses its trace as it stops; refused here, nothing starts."""
    if args.redis_url:
        check_redis_url(args.redis_url)
    num_pipelines = getattr(args, "pipelines", 1)
    suffixes = [f".p{i}" for i in range(num_pipelines)] if num_pipelines > 1 else [""]
    for flag, path in (("--timeline", args.timeline), ("--trace-scheduler", args.trace_scheduler)):
        for suffix in suffixes if path else []:
            check_output_file(path + suffix, flag)
    if getattr(args, "record_plans", None):
        check_output_dir(args.record_plans, "--record-plans")


def check_ports(args: argparse.Namespace) -> None:
    """Every port the command line names belongs to one server: a port named twice is
    refused before anything starts, naming both flags (the child that loses the race would
    only report the port taken)."""
    owners: dict[int, str] = {}
    for flag, ports in _ports_by_flag(args).items():
        name = flag if len(ports) == 1 else f"{flag} (ports {ports[0]}-{ports[-1]})"
        if ports[-1] > MAX_PORT:
            raise ConfigError(f"{name} goes past the last port, {MAX_PORT}")
        for port in ports:
            if port in owners:
                raise ConfigError(f"port {port} is named twice, by {owners[port]} and {name}")
            owners[port] = name


def check_parallel(args: argparse.Namespace) -> int:
    """--tensor-parallel-size, checked against the model (heads, vocabulary) and against
    this machine: stages x ranks processes need as many cores (CPU) or GPUs (CUDA)."""
    tp_size = getattr(args, "tensor_parallel_size", 1)
    if tp_size == 1:
        return 1
    if args.device == "sim":
        raise ConfigError(
            f"--tensor-parallel-size={tp_size} runs real ranks; with --device sim model them "
            "with --sim-tensor-parallel-size"
        )
    from services.worker.model.config import ModelConfig
    from services.worker.model.tensor_parallel import check_tensor_parallel

    try:
        model = ModelConfig.from_dir(args.model)
    except ModelLoadError as exc:
        raise ConfigError(str(exc)) from exc
    check_tensor_parallel(model, tp_size, source=args.model)
    num_ranks = args.stages * tp_size
    if args.device == "cuda":
        import torch

        have, what = torch.cuda.device_count(), "GPUs"
    else:
        have, what = cpu_budget(), "cores"  # its affinity, within its CPU quota
    if num_ranks > have and not (args.device == "cpu" and getattr(args, "oversubscribe", False)):
        raise ConfigError(
            f"--tensor-parallel-size={tp_size} x --pipeline-parallel-size={args.stages} = "
            f"{num_ranks} worker processes, but this machine has {have} {what}"
            + (" (--oversubscribe allows it on CPU)" if args.device == "cpu" else "")
        )
    return tp_size


def _security_args(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """(flags of the workers and the scheduler, flags of the router). Logs how the stack is
    protected: unauthenticated unless credentials were given."""
    check_tls_files(args.tls_cert, args.tls_key)
    if bool(args.tls_cert) != bool(args.tls_ca):
        raise ConfigError(
            "conveyor up runs TLS between every service or none: give --tls-cert, --tls-key "
            "and --tls-ca (the CA that signed the certificate; `conveyor certs` makes both)"
        )
    if args.tls_client_ca and not args.tls_cert:
        raise ConfigError("--tls-client-ca needs --tls-cert, --tls-key and --tls-ca")
    tls = []
    if args.tls_cert:
        tls = ["--tls-cert", args.tls_cert, "--tls-key", args.tls_key, "--tls-ca", args.tls_ca]
    token = ["--internal-token-file", args.internal_token_file] if args.internal_token_file else []
    keys = ["--api-key-file", args.api_key_file] if args.api_key_file else []
    # read as every child will read it: a blank or unreadable token is refused before
    # anything starts, Redis included
    has_token = internal_token(args.internal_token_file, os.environ) is not None
    if not (keys or args.tls_client_ca):
        logger.info(
            "unauthenticated mode: clients of the router on %s are anonymous (--api-key-file "
            "turns on API keys)",
            args.host,
        )
    if not (has_token or args.tls_ca):
        logger.info(
            "internal services unauthenticated: the workers, the scheduler and the "
            "rendezvous listen on %s only (--internal-token-file or --tls-ca protect them "
            "from other local users)",
            INTERNAL_HOST,
        )
    public = [*tls, *token, *keys]
    if args.tls_client_ca:
        public += ["--tls-client-ca", args.tls_client_ca]
    return [*tls, *token], public


def _serves_http(args: argparse.Namespace) -> bool:
    """The router serves the HTTP API unless --no-http, or client certificates without API
    keys (the HTTP API authenticates with keys only)."""
    return not args.no_http and not (args.tls_client_ca and not args.api_key_file)


def _http_args(args: argparse.Namespace) -> list[str]:
    if _serves_http(args):
        return ["--http-port", str(args.http_port)]
    if not args.no_http:
        logger.warning(
            "no OpenAI-compatible HTTP API: with --tls-client-ca it needs --api-key-file "
            "(it cannot read client certificates' identities)"
        )
    return []


def _client_security(args: argparse.Namespace) -> ClientSecurity:
    """How the launcher reaches the services' health: their CA and, for mutual TLS, the
    services' certificate."""
    if not args.tls_ca:
        return ClientSecurity()
    return ClientSecurity.from_files(args.tls_ca, args.tls_cert, args.tls_key)


def _connect_host(host: str) -> str:
    """An address to reach a server bound to `host` from this machine."""
    if host.strip("[]") in ("", "0.0.0.0", "::"):
        return INTERNAL_HOST
    return host if ":" not in host or host.startswith("[") else f"[{host}]"


def _device_args(args: argparse.Namespace) -> list[str]:
    """--device and, for a simulated device, its --sim-* flags, for each worker."""
    if args.device == "cpu":
        return []
    argv = ["--device", args.device]
    if args.device == "sim":
        argv += ["--sim-profile", args.sim_profile]
        argv += ["--sim-tensor-parallel-size", str(args.sim_tensor_parallel_size)]
        if args.sim_link_bandwidth is not None:
            argv += ["--sim-link-bandwidth", str(args.sim_link_bandwidth)]
        if args.sim_link_latency is not None:
            argv += ["--sim-link-latency", str(args.sim_link_latency)]
    return argv


def _ports_by_flag(args: argparse.Namespace) -> dict[str, list[int]]:
    """The ports the command line names, by flag: whole ranges of them where one flag gives
    several (--scheduler-port per pipeline, --metrics-port per child)."""
    num_pipelines = getattr(args, "pipelines", 1)
    num_ranks = args.stages * getattr(args, "tensor_parallel_size", 1)
    ports = {"--port": [args.port]}
    if _serves_http(args):
        ports["--http-port"] = [args.http_port]
    if args.scheduler_port is not None:
        ports["--scheduler-port"] = [args.scheduler_port + i for i in range(num_pipelines)]
    if args.metrics_port is not None:
        num_children = 2 + num_pipelines * (1 + num_ranks)
        ports["--metrics-port"] = [args.metrics_port + i for i in range(num_children)]
    return ports


def _named_ports(args: argparse.Namespace) -> list[int]:
    """The ports the command line names, for `reserve_ports`."""
    return [port for ports in _ports_by_flag(args).values() for port in ports]


def _observability_args(args: argparse.Namespace, offset: int) -> list[str]:
    """--metrics-port (the router on N, the scheduler on N+1, worker i on N+2+i, stage-major) and
    --otlp-endpoint for one child."""
    argv = []
    if args.metrics_port is not None:
        argv += ["--metrics-port", str(args.metrics_port + offset)]
    if args.otlp_endpoint:
        argv += ["--otlp-endpoint", args.otlp_endpoint]
    return argv


def check_draft_model(args: argparse.Namespace) -> None:
    """A draft model (`--speculative-config '{"model": DIR}'`) must load and share the
    served model's vocabulary; raises ConfigError naming both sizes otherwise."""
    from services.scheduler.speculative import SpeculativeConfig
    from services.worker.model.config import ModelConfig

    if not args.speculative_config:
        return
    spec = SpeculativeConfig.from_json(args.speculative_config)
    if not spec.uses_draft_model:
        return
    if args.device == "sim":
        raise ConfigError("a draft model runs on a real device: --device sim takes none")
    try:
        draft = ModelConfig.from_dir(spec.model)
    except ModelLoadError as exc:
        raise ConfigError(f"--speculative-config: the draft model {spec.model}: {exc}") from None
    try:
        target = ModelConfig.from_dir(args.model)
    except ModelLoadError as exc:
        raise ConfigError(f"--model {args.model}: {exc}") from None
    if draft.vocab_size != target.vocab_size:
        raise ConfigError(
            f"--speculative-config: the draft model {spec.model} has a vocabulary of "
            f"{draft.vocab_size} tokens, the served model {args.model} {target.vocab_size}: a "
            "draft model must share the served model's tokenizer"
        )


def _spawn_draft_worker(
    stack: Stack, args: argparse.Namespace, name: str, internal: list[str], env: dict[str, str]
) -> str | None:
    """The draft worker of one pipeline (a "draft_model" --speculative-config); returns its
    address, or None when there is none."""
    from services.scheduler.speculative import SpeculativeConfig

    if not args.speculative_config:
        return None
    spec = SpeculativeConfig.from_json(args.speculative_config)
    if not spec.uses_draft_model:
        return None
    port = free_port()
    argv = ["worker", "--draft", "--model", spec.model, "--port", str(port)]
    argv += ["--host", INTERNAL_HOST, *internal, "--kv-cache-memory", args.kv_cache_memory]
    argv += ["--dtype", args.dtype, *_device_args(args)]
    if args.threads:
        argv += ["--threads", str(args.threads)]
    if getattr(args, "max_model_len", None) is not None:
        argv += ["--max-model-len", str(args.max_model_len)]
    stack.spawn(f"worker draft ({name})" if name else "worker draft", argv, env)
    return f"{INTERNAL_HOST}:{port}"


def _speculative_config(text: str) -> str:
    """--speculative-config is checked before any process starts (the scheduler parses it
    again); a bad one is a usage error naming what is wrong."""
    from services.scheduler.speculative import SpeculativeConfig

    try:
        return SpeculativeConfig.from_json(text).to_json()
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--speculative-config: ")) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="Hugging Face model directory")
    parser.add_argument(
        "--stages",
        "--pipeline-parallel-size",
        dest="stages",
        type=at_least(1),
        default=2,
        help="pipeline stages, one worker process per tensor-parallel rank each (default: 2)",
    )
    parser.add_argument(
        "--tensor-parallel-size",
        type=at_least(1),
        default=1,
        help="tensor-parallel ranks per stage, one worker process each; stages x ranks must "
        "not exceed the cores (CPU) or GPUs (CUDA) (default: 1)",
    )
    parser.add_argument(
        "--oversubscribe",
        action="store_true",
        help="CPU: allow more worker processes (stages x tp ranks) than cores, e.g. to "
        "measure tensor parallelism on a small machine (default: refused)",
    )
    parser.add_argument(
        "--pipelines",
        type=at_least(1),
        default=1,
        help="pipelines (a scheduler and its stage workers each) behind the router, sharing "
        "one Redis: requests are routed by cached prefix and load, and a lost pipeline's "
        "requests are adopted by another (docs/scale-out.md) (default: 1)",
    )
    parser.add_argument(
        "--port", type=port_number, default=50051, help="public gRPC port (default: 50051)"
    )
    parser.add_argument(
        "--host",
        default=INTERNAL_HOST,
        help="the router's bind address; the other services always listen on 127.0.0.1 "
        f"(default: {INTERNAL_HOST}; [::] for every interface)",
    )
    parser.add_argument(
        "--redis-url",
        default=None,
        help="Redis to keep request state in (default: start a private redis-server)",
    )
    parser.add_argument(
        "--scheduling",
        choices=["async", "sync"],
        default="async",
        help="scheduling mode (default: async)",
    )
    parser.add_argument(
        "--speculative-config",
        default=None,
        type=_speculative_config,
        help='speculative decoding, passed to the scheduler: \'{"method": "ngram", '
        '"num_speculative_tokens": 4, "prompt_lookup_max": 4}\', or a draft model, '
        '\'{"model": DIR, "num_speculative_tokens": 4}\', which a draft worker runs '
        "(default: off)",
    )
    parser.add_argument(
        "--kv-cache-memory",
        default="1GiB",
        help="KV cache budget per stage, e.g. 512MiB (default: 1GiB)",
    )
    parser.add_argument(
        "--max-model-len",
        type=at_least(1),
        default=None,
        help="the stack's context length: the router refuses longer requests and advertises "
        "it, the workers size their KV cache for it (a small --kv-cache-memory needs a small "
        "one) (default: the model's)",
    )
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument(
        "--quantization",
        choices=list(QUANTIZATIONS),
        default=None,
        help="workers' weight-only quantization, per output channel at load "
        "(default: the checkpoint's own)",
    )
    parser.add_argument(
        "--quantization-ignore",
        default=None,
        metavar="PROJ[,PROJ]",
        help="decoder projections the workers keep in --dtype, or none "
        "(default: down_proj for fp8, none for int8)",
    )
    parser.add_argument(
        "--device",
        choices=list(DEVICES),
        default=default_of(WorkerConfig, "device"),
        help="the workers' device; sim models the forward pass on --sim-profile's hardware "
        "(docs/simulation.md) (default: cpu)",
    )
    add_sim_arguments(parser)
    parser.add_argument(
        "--threads",
        type=at_least(1),
        default=None,
        help="intra-op threads per worker (default: the cores this process may use, within its "
        "CPU limit, / (stages x tp ranks x pipelines))",
    )
    parser.add_argument("--layer-split", default=None, help="layers per stage, e.g. 15,15")
    parser.add_argument(
        "--linear-backend",
        choices=["auto", "onednn", "torch"],
        default="auto",
        help="workers' matmul kernels (default: auto = onednn on CPU, with the C++ "
        "small-batch and fused kernels)",
    )
    parser.add_argument(
        "--cpu-affinity",
        choices=["auto", "off"],
        default="auto",
        help="auto: pin each worker to its own cores when workers x threads fit "
        "on this machine's cores (default: auto)",
    )
    parser.add_argument(
        "--scheduler-port",
        type=port_number,
        default=None,
        help="scheduler gRPC port (default: a free port)",
    )
    parser.add_argument(
        "--timeline",
        default=None,
        help="write a Chrome/Perfetto trace of the pipeline to FILE on stop",
    )
    parser.add_argument(
        "--hang-timeout",
        type=checked(float, lambda s: s >= 0, ">= 0"),
        default=None,
        metavar="SECONDS",
        help="each worker exits when one step has computed longer than this, and is "
        "restarted (conveyor worker --hang-timeout; 0: never) (default: the worker's, 600)",
    )
    parser.add_argument(
        "--record-plans",
        default=None,
        metavar="DIR",
        help="each worker writes the plans it receives to DIR/stage<S>.plans (p<N>-stage<S> "
        "with --pipelines, .<rank> with tensor parallelism), to run them again alone with "
        "`python -m services.bench.replay_plans` (default: off)",
    )
    parser.add_argument(
        "--metrics-port",
        type=port_number,
        default=None,
        metavar="N",
        help="Prometheus metrics: the router on N, the scheduler on N+1, "
        "worker i on N+2+i, i = stage x ranks + tp rank; unauthenticated, and on every "
        "interface (0.0.0.0) whatever --host says (default: off)",
    )
    parser.add_argument(
        "--otlp-endpoint",
        default=None,
        help="export OpenTelemetry spans of every service: http://HOST:4317, "
        "grpc://HOST:PORT or file:///PATH (default: off)",
    )
    parser.add_argument(
        "--trace-scheduler",
        default=None,
        metavar="FILE",
        help="the scheduler appends every request transition and step plan to FILE as JSON lines",
    )
    parser.add_argument(
        "--startup-timeout",
        type=checked(float, lambda s: s > 0, "> 0"),
        default=300.0,
        help="seconds to wait for every service to be SERVING (default: 300)",
    )
    parser.add_argument(
        "--max-restarts",
        type=at_least(0),
        default=5,
        help="restarts of one dead child (worker, scheduler, router, private Redis) allowed "
        f"within {RESTART_WINDOW_S:.0f} s before the stack stops; 0 stops it at the first "
        "death (default: 5)",
    )
    parser.add_argument(
        "--scheduler-arg",
        dest="scheduler_args",
        action="append",
        default=[],
        help="extra flag passed to the scheduler, e.g. --scheduler-arg=--max-num-seqs=64",
    )
    parser.add_argument(
        "--http-port",
        type=port_number,
        default=DEFAULT_HTTP_PORT,
        help="the router's OpenAI-compatible HTTP API on this port, bound like --port "
        f"(default: {DEFAULT_HTTP_PORT})",
    )
    parser.add_argument("--no-http", action="store_true", help="serve no HTTP API (gRPC only)")
    parser.add_argument(
        "--router-arg",
        dest="router_args",
        action="append",
        default=[],
        help="extra flag passed to the router",
    )
    parser.add_argument(
        "--api-key-file",
        default=None,
        metavar="FILE",
        help="the router's API keys (`conveyor keys add`) (default: off: clients are anonymous)",
    )
    add_tls_arguments(
        parser,
        cert_help="PEM certificate of every service (the router's public port too); it must "
        "be valid for 127.0.0.1",
        ca_help="PEM CA of the services' certificates: mutual TLS between them",
        environ=os.environ,
    )
    parser.add_argument(
        "--tls-client-ca",
        default=None,
        metavar="PEM",
        help="the router asks clients for certificates signed by this CA (default: none)",
    )
    add_internal_token_argument(parser, "file holding the token between the services")


def run(args: argparse.Namespace) -> int:
    stack = Stack(max_restarts=args.max_restarts)

    def _on_signal(signum, _frame):
        stack.stopping = True

    # Before the first child starts: a SIGTERM that arrives while the stack is starting must
    # still stop it in order (scheduler before workers, so --timeline is written), not kill
    # this process with the children left to die all at once.
    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    try:
        _, address = start_stack(args, stack)
    except StackStopped:
        return 0
    except StackFailed as exc:
        logger.error("%s; the stack did not start", exc)
        return 1
    except (TimeoutError, RuntimeError) as exc:  # a child never served, or exited
        logger.error(
            "%s; the stack did not start: the children's log lines above say why (e.g. Redis "
            "refusing the scheduler's password, a port taken)",
            exc,
        )
        return 1
    tp_note = f" x {args.tensor_parallel_size} tp ranks" if args.tensor_parallel_size > 1 else ""
    http = f", OpenAI API on port {args.http_port}" if _serves_http(args) else ""
    pipelines = f"{args.pipelines} pipelines x " if args.pipelines > 1 else ""
    print(
        f"conveyor is serving on {address} ({pipelines}{args.stages} stages{tp_note}, "
        f"{args.scheduling}{http}); scheduler on {','.join(stack.scheduler_addresses)}",
        flush=True,
    )
    try:
        while not stack.stopping:
            stack.supervise()
            time.sleep(0.5)
    except StackFailed as exc:
        logger.error("%s; stopping the stack", exc)
        return 1
    finally:
        stack.stop()
    return 0


def _spawn_pipeline(
    stack: Stack,
    args: argparse.Namespace,
    index: int,
    num_pipelines: int,
    redis_url: str,
    internal: list[str],
    env: dict[str, str],
    pinned: list[list[int]] | None,
) -> None:
    """The workers and the scheduler of pipeline `index` (named p<index> when there are
    several: docs/scale-out.md)."""
    tp_size = getattr(args, "tensor_parallel_size", 1)
    num_ranks = args.stages * tp_size
    name = f"p{index}" if num_pipelines > 1 else ""
    dist_addr = f"{INTERNAL_HOST}:{free_port()}"
    worker_addrs = []
    for rank in range(num_ranks):  # stage-major: the order --workers wants
        stage, tp_rank = divmod(rank, tp_size)
        port = free_port()
        worker_addrs.append(f"{INTERNAL_HOST}:{port}")
        argv = [
            "worker",
            "--model",
            args.model,
            "--stage",
            str(stage),
            "--stages",
            str(args.stages),
            "--tensor-parallel-size",
            str(tp_size),
            "--tp-rank",
            str(tp_rank),
            "--dist-addr",
            dist_addr,
            "--port",
            str(port),
            "--host",
            INTERNAL_HOST,
            *internal,
            "--kv-cache-memory",
            args.kv_cache_memory,
            "--dtype",
            args.dtype,
        ]
        if args.threads:
            argv += ["--threads", str(args.threads)]
        if getattr(args, "max_model_len", None) is not None:
            argv += ["--max-model-len", str(args.max_model_len)]
        if args.layer_split:
            argv += ["--layer-split", args.layer_split]
        if args.linear_backend != "auto":
            argv += ["--linear-backend", args.linear_backend]
        if args.quantization:
            argv += ["--quantization", args.quantization]
        if args.quantization_ignore is not None:
            argv += ["--quantization-ignore", args.quantization_ignore]
        if pinned:
            argv += ["--cpu-affinity", ",".join(map(str, pinned[rank]))]
        if getattr(args, "hang_timeout", None) is not None:
            argv += ["--hang-timeout", str(args.hang_timeout)]
        if getattr(args, "record_plans", None):
            file = f"{name}-stage{stage}" if name else f"stage{stage}"
            if tp_size > 1:
                file += f".{tp_rank}"
            argv += ["--record-plans", str(Path(args.record_plans) / f"{file}.plans")]
        argv += _device_args(args)
        argv += _observability_args(args, 2 + rank + index * (1 + num_ranks))
        label = f"worker {stage}" + (f".{tp_rank}" if tp_size > 1 else "")
        stack.spawn(f"{label} ({name})" if name else label, argv, env)
    scheduler_port = (args.scheduler_port + index if args.scheduler_port else None) or free_port()
    scheduler_addr = f"{INTERNAL_HOST}:{scheduler_port}"
    stack.scheduler_address = stack.scheduler_address or scheduler_addr
    stack.scheduler_addresses.append(scheduler_addr)
    argv = [
        "scheduler",
        "--workers",
        ",".join(worker_addrs),
        "--redis-url",
        redis_url,
        "--port",
        str(scheduler_port),
        "--host",
        INTERNAL_HOST,
        *internal,
        "--scheduling",
        args.scheduling,
        *args.scheduler_args,
    ]
    if args.speculative_config:
        argv += ["--speculative-config", args.speculative_config]
    draft_addr = _spawn_draft_worker(stack, args, name, internal, env)
    if draft_addr:
        argv += ["--draft-worker", draft_addr]
    suffix = f".{name}" if name else ""  # one file per pipeline
    if args.timeline:
        argv += ["--timeline", args.timeline + suffix]
    if args.trace_scheduler:
        argv += ["--trace-scheduler", args.trace_scheduler + suffix]
    if name:
        argv += ["--pipeline-id", name, "--advertise-address", scheduler_addr]
    argv += _observability_args(args, 1 + index * (1 + num_ranks))
    stack.spawn(f"{name} scheduler" if name else "scheduler", argv, env)

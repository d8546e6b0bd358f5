"""Credentials and stacks for the security tests.

Certificates are made in the test (the `cryptography` package, through
services/common/certs.py), API keys with the key-file format of `conveyor keys add`, and
every stack is real processes: stage workers and a scheduler (tests/integration/utils.py's
`ProcessStack`, so they can be killed and restarted) behind a real `conveyor router`.

Helpers of the security tests: the stack under attack, raw calls, outcome checks."""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.client.client import ConveyorClient
from services.common.proto.conveyor.v1 import generation_pb2_grpc, scheduler_pb2_grpc
from services.common.proto.inference import grpc_service_pb2_grpc as kserve_pb2_grpc
from tests.conftest import free_port
from tests.integration.utils import ProcessStack
from tests.router.utils import RouterProcess

# Stacks without credentials use only what existed before authentication did, so that the
# tests of the rows also run (and fail) against the code they were written for.

# principal -> (tenant, priority_max) of the test's API keys
PRINCIPALS = {"alice": ("team-a", 0), "bob": ("team-b", 0), "mallory": ("team-m", 5)}


@dataclass
class Credentials:
    """Everything a secured stack and its clients need, made in a temporary folder."""

    ca: Path
    cert: Path
    key: Path
    token_file: Path
    token: str
    key_file: Path
    api_keys: dict[str, str] = field(default_factory=dict)
    """principal -> its API key."""

    @property
    def internal_args(self) -> list[str]:
        """Flags of a worker or the scheduler: mutual TLS and the internal token."""
        return [
            "--tls-cert",
            str(self.cert),
            "--tls-key",
            str(self.key),
            "--tls-ca",
            str(self.ca),
            "--internal-token-file",
            str(self.token_file),
        ]

    @property
    def router_args(self) -> list[str]:
        """Flags of the router: API keys, TLS on the public port, mutual TLS and the token
        to the scheduler."""
        return [*self.internal_args, "--api-key-file", str(self.key_file)]

    @property
    def internal_client(self):
        """An operator or router: the internal CA, a certificate and the token."""
        from services.common.security import ClientSecurity

        return ClientSecurity.from_files(self.ca, self.cert, self.key, self.token)

    def client(self, principal: str | None, address: str, **kwargs) -> ConveyorClient:
        """A client of the router as `principal` (None: no API key), over TLS."""
        api_key = self.api_keys[principal] if principal else None
        return ConveyorClient(
            address, timeout_s=120, api_key=api_key, tls_ca=str(self.ca), **kwargs
        )


def make_credentials(folder: Path) -> Credentials:
    from services.common.certs import write_certs
    from services.router.api_keys import format_line, new_key

    files = write_certs(folder / "certs")
    token = secrets.token_urlsafe(24)
    token_file = folder / "internal-token"
    token_file.write_text(token + "\n")
    api_keys, lines = {}, ["# made by tests/security/utils.py"]
    for principal, (tenant, priority_max) in PRINCIPALS.items():
        api_keys[principal] = new_key()
        lines.append(format_line(api_keys[principal], principal, tenant, priority_max))
    key_file = folder / "api-keys"
    key_file.write_text("\n".join(lines) + "\n")
    return Credentials(files.ca, files.cert, files.key, token_file, token, key_file, api_keys)


class RouterStack:
    """Stage workers and a scheduler (`ProcessStack`) behind one real router."""

    def __init__(
        self,
        model_dir: Path,
        stages: int,
        credentials: Credentials | None = None,
        max_model_len: int = 2048,
        router_args: tuple[str, ...] = (),
    ):
        creds = credentials
        self.credentials = creds
        pipeline_security, router_security = {}, {}
        if creds:
            from services.common.security import ClientSecurity

            pipeline_security = {"security": creds.internal_client}
            router_security = {"security": ClientSecurity.from_files(creds.ca)}
        self.pipeline = ProcessStack(
            model_dir,
            stages,
            kv_cache_memory="32MiB",
            max_model_len=max_model_len,
            worker_args=creds.internal_args if creds else [],
            scheduler_args=creds.internal_args if creds else [],
            **pipeline_security,
        )
        self.router = RouterProcess(
            self.pipeline.address,
            model_dir,
            *(creds.router_args if creds else []),
            *router_args,
            **router_security,
        )

    @property
    def address(self) -> str:
        return self.router.address

    def start(self) -> RouterStack:
        try:
            self.pipeline.start()
            self.router.wait_serving(120)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        self.router.stop()
        self.pipeline.stop()


@dataclass
class Stream:
    """A generation running in a thread: its deltas as they come, and how it ended."""

    thread: threading.Thread | None = None
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: grpc.RpcError | None = None
    started: threading.Event = field(default_factory=threading.Event)

    def join(self, timeout_s: float = 300) -> Stream:
        self.thread.join(timeout_s)
        assert not self.thread.is_alive(), "the stream did not end"
        return self


def stream_in_thread(client: ConveyorClient, **kwargs) -> Stream:
    """Starts `client.generate(**kwargs)` in a thread; `started` is set at the first token."""
    stream = Stream()

    def run() -> None:
        try:
            for delta in client.generate(**kwargs):
                stream.token_ids.extend(delta.token_ids)
                if delta.token_ids:
                    stream.started.set()
                stream.finish_reason = delta.finish_reason or stream.finish_reason
        except grpc.RpcError as exc:
            stream.error = exc
        finally:
            stream.started.set()

    stream.thread = threading.Thread(target=run, daemon=True)
    stream.thread.start()
    return stream


ROOT = Path(__file__).resolve().parents[2]
REDIS_DB = 9  # a database of the session's private Redis that no other test area uses
TIGHT_ROUTER_ARGS = (
    "--max-concurrent-rpcs",
    "3",
    "--max-stream-requests",
    "2",
    "--max-prompt-bytes",
    str(4 << 20),
)
"""The tight router: 3 RPCs at once, 2 requests per KServe stream, prompts up to 4 MiB."""
# Answers a hostile request may get; INTERNAL or UNKNOWN would be a bug, UNAVAILABLE or
# DEADLINE_EXCEEDED a service the request broke or stalled.
REFUSALS = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,  # a model name or request id that is not there
    grpc.StatusCode.ALREADY_EXISTS,  # a request id still in use
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}


@dataclass
class Stack:
    """A running `conveyor up`: the public router and the scheduler behind it."""

    proc: subprocess.Popen
    router: str
    scheduler: str
    redis_url: str
    model_name: str
    log: Path

    def __post_init__(self) -> None:
        self.router_channel = grpc.insecure_channel(self.router)
        self.scheduler_channel = grpc.insecure_channel(self.scheduler)
        self.generation = generation_pb2_grpc.GenerationStub(self.router_channel)
        self.kserve = kserve_pb2_grpc.GRPCInferenceServiceStub(self.router_channel)
        self.scheduler_stub = scheduler_pb2_grpc.SchedulerStub(self.scheduler_channel)

    def is_serving(self) -> bool:
        """Router and scheduler both answer their health check with SERVING."""
        for channel in (self.router_channel, self.scheduler_channel):
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=10
            )
            if reply.status != health_pb2.HealthCheckResponse.SERVING:
                return False
        return True

    def stop(self) -> None:
        self.router_channel.close()
        self.scheduler_channel.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def start_stack(model_dir: Path, redis_url: str, workdir: Path) -> Stack:
    """`conveyor up` of `model_dir` (1 stage) over database REDIS_DB of `redis_url`."""
    import redis

    from services.launcher import wait_serving

    url = redis_url.rsplit("/", 1)[0] + f"/{REDIS_DB}"
    redis.Redis.from_url(url).flushdb()  # no request of another session is recovered
    port, scheduler_port = free_port(), free_port()
    log_path = workdir / "conveyor-up.log"
    argv = [
        *(sys.executable, "-m", "services.cli", "--log-level", "WARNING", "up", "--no-http"),
        *("--model", str(model_dir), "--stages", "1", "--redis-url", url),
        *("--port", str(port), "--scheduler-port", str(scheduler_port)),
        *("--kv-cache-memory", "16MiB", "--threads", "1", "--cpu-affinity", "off"),
    ]
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            argv, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=log, stderr=log
        )
    stack = Stack(
        proc,
        f"127.0.0.1:{port}",
        f"127.0.0.1:{scheduler_port}",
        url,
        Path(model_dir).name,
        log_path,
    )
    try:
        wait_serving(stack.router, 300, proc)
    except BaseException:
        print(log_path.read_text()[-5000:], file=sys.stderr)
        stack.stop()
        raise
    return stack


def first_outcome(call) -> grpc.StatusCode:
    """OK once a streaming call yields its first message (then cancelled), else its error
    code."""
    try:
        next(iter(call))
    except StopIteration:
        return grpc.StatusCode.OK
    except grpc.RpcError as exc:
        return exc.code()
    finally:
        call.cancel()
    return grpc.StatusCode.OK


def unary_outcome(fn, *args, **kwargs) -> grpc.StatusCode:
    """OK, or the error code of a unary call."""
    try:
        fn(*args, **kwargs)
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def rpc_error(fn, *args, **kwargs) -> grpc.RpcError:
    """The error a call (unary, or a stream read to its end) must raise."""
    try:
        result = fn(*args, **kwargs)
        if hasattr(result, "__iter__") and not hasattr(result, "SerializeToString"):
            for _ in result:
                pass
    except grpc.RpcError as exc:
        return exc
    raise AssertionError("the call succeeded; a refusal was expected")

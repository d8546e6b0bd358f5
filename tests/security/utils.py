"""Helpers of the security tests: the stack under attack, raw calls, outcome checks."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.proto.conveyor.v1 import generation_pb2_grpc, scheduler_pb2_grpc
from services.common.proto.inference import grpc_service_pb2_grpc as kserve_pb2_grpc
from tests.conftest import free_port

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
        *(sys.executable, "-m", "services.cli", "--log-level", "WARNING", "up"),
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

"""Two 1-stage SmolLM2 pipelines over one Redis, and routers in front of them, as real
processes the tests start, inspect and kill (for good: nothing restarts them).

    redis ── p0: scheduler + worker      routers: prefix (--redis-url, --schedulers)
          └─ p1: scheduler + worker               round-robin (same pipelines)

This is the layout `conveyor up --pipelines 2` starts (services/launcher.py), kept under the
test's hand so that a pipeline can be lost for good.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.proto.conveyor.v1 import (
    scheduler_pb2,
    scheduler_pb2_grpc,
)
from services.common.redis_server import free_port
from tests.faults.utils import RedisProcess, wait_until
from tests.faults.utils import run_streams as fault_streams

ROOT = Path(__file__).resolve().parents[2]
SERVING = health_pb2.HealthCheckResponse.SERVING
KV_CACHE_MEMORY = "32MiB"
"""45 blocks of 16 tokens per pipeline (SmolLM2-135M, float32: 720 KiB a block)."""
MAX_MODEL_LEN = 512
ANNOUNCE_TTL_S = 1.5
ADOPT_GRACE_S = 4.0


@dataclass
class Pipeline:
    name: str
    scheduler: str
    worker: str
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    argv: dict[str, list[str]] = field(default_factory=dict)

    def stats(self) -> scheduler_pb2.SchedulerStats:
        with grpc.insecure_channel(self.scheduler) as channel:
            stub = scheduler_pb2_grpc.SchedulerStub(channel)
            return stub.GetStats(scheduler_pb2.GetStatsRequest(), timeout=10)

    def kill(self, *names: str) -> None:
        """SIGKILL the scheduler and its worker (default: both, the pipeline is lost)."""
        for name in names or tuple(self.procs):
            proc = self.procs[name]
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait()


class ScaleOutStack:
    """Redis, two pipelines and two routers (prefix and round-robin routing)."""

    def __init__(
        self,
        model_dir: Path,
        workdir: Path,
        num_pipelines: int = 2,
        router_args: tuple[str, ...] = (),
    ):
        """`router_args`: more flags for both routers (--api-key-file, say)."""
        self.model_dir = model_dir
        self.log = (workdir / "stack.log").open("w")
        self.redis = RedisProcess(workdir).start(fresh=True)
        self.pipelines = [self._start_pipeline(f"p{i}") for i in range(num_pipelines)]
        schedulers = ",".join(p.scheduler for p in self.pipelines)
        self.routers: dict[str, str] = {}
        self._router_procs: list[subprocess.Popen] = []
        for routing in ("prefix", "round-robin"):
            port = free_port()
            self._router_procs.append(
                self._spawn(
                    "router",
                    "--schedulers",
                    schedulers,
                    "--redis-url",
                    self.redis.url,
                    "--routing",
                    routing,
                    "--model",
                    str(model_dir),
                    "--port",
                    str(port),
                    "--host",
                    "127.0.0.1",
                    *router_args,
                )
            )
            self.routers[routing] = f"127.0.0.1:{port}"

    def _spawn(self, *argv: str) -> subprocess.Popen:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        cmd = [sys.executable, "-m", "services.cli", *argv]
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=self.log, stderr=self.log)

    def _start_pipeline(self, name: str) -> Pipeline:
        worker_port, scheduler_port = free_port(), free_port()
        pipeline = Pipeline(name, f"127.0.0.1:{scheduler_port}", f"127.0.0.1:{worker_port}")
        pipeline.argv["worker"] = [
            "worker",
            "--model",
            str(self.model_dir),
            "--stage",
            "0",
            "--stages",
            "1",
            "--dist-addr",
            f"127.0.0.1:{free_port()}",
            "--port",
            str(worker_port),
            "--host",
            "127.0.0.1",
            "--kv-cache-memory",
            KV_CACHE_MEMORY,
            "--max-model-len",
            str(MAX_MODEL_LEN),
            "--threads",
            "1",
            # The plain torch attention path: these tests are about routing and adoption,
            # and the C++ kernel's build costs every fresh worker a minute or more here.
            "--attention-backend",
            "torch",
        ]
        pipeline.procs["worker"] = self._spawn(*pipeline.argv["worker"])
        pipeline.procs["scheduler"] = self._spawn(
            "scheduler",
            "--workers",
            pipeline.worker,
            "--redis-url",
            self.redis.url,
            "--port",
            str(scheduler_port),
            "--host",
            "127.0.0.1",
            "--pipeline-id",
            name,
            "--advertise-address",
            pipeline.scheduler,
            "--announce-ttl",
            str(ANNOUNCE_TTL_S),
            "--adopt-grace",
            str(ADOPT_GRACE_S),
            "--orphan-timeout",
            "30",
        )
        return pipeline

    def restart(self, pipeline: Pipeline, name: str) -> None:
        """Starts `name` ("worker") of `pipeline` again, as it was started."""
        pipeline.procs[name] = self._spawn(*pipeline.argv[name])

    def wait_serving(self, timeout_s: float = 300) -> None:
        addresses = [p.scheduler for p in self.pipelines] + list(self.routers.values())
        wait_until(lambda: all(health(a) == SERVING for a in addresses), timeout_s, 0.5)
        # Every router sees both pipelines (their announcements are in Redis).
        num = len(self.pipelines)
        wait_until(lambda: len(self.redis.client().smembers("conveyor:pipelines")) == num, 30)

    def kill_router(self, routing: str) -> None:
        """SIGKILL the router of that routing policy (its clients' streams die with it)."""
        proc = self._router_procs[list(self.routers).index(routing)]
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()

    def stop(self) -> None:
        procs = self._router_procs + [p for pl in self.pipelines for p in pl.procs.values()]
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.redis.stop()
        self.log.close()

    # -- measurements ---------------------------------------------------------------------
    def prefix_counters(self) -> tuple[int, int]:
        """(hit, queried) prompt tokens of the prefix caches, both pipelines together."""
        stats = [p.stats() for p in self.pipelines]
        return (
            sum(s.num_prefix_hit_tokens for s in stats),
            sum(s.num_prefix_queried_tokens for s in stats),
        )


def health(address: str, timeout_s: float = 1.0) -> int | None:
    with grpc.insecure_channel(address) as channel:
        try:
            stub = health_pb2_grpc.HealthStub(channel)
            return stub.Check(health_pb2.HealthCheckRequest(), timeout=timeout_s).status
        except grpc.RpcError:
            return None


def run_streams(
    router: str, prompts: list[list[int]], max_tokens: int, fault=None, after_tokens: int = 0
):
    """tests/faults' run_streams, waiting longer for the fault's moment (two stacks start)."""
    return fault_streams(router, prompts, max_tokens, fault, after_tokens, fault_wait_s=300)

"""A real stack for integration tests: Redis, stage worker processes, the scheduler process.

Each service is its own process (as in production), so a test can kill and restart one.
Clients talk to the scheduler over real gRPC on loopback.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field

from services.common.process import child_env
from services.common.proto.conveyor.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from services.common.redis_server import RedisServer, free_port
from services.common.security import ClientSecurity
from services.launcher import wait_serving

_ids = itertools.count()


@dataclass
class Outcome:
    token_ids: list[int]
    finish_reason: int
    offsets: list[int] = field(default_factory=list)


class ProcessStack:
    """Workers and a scheduler as child processes; stop() leaves nothing running."""

    def __init__(
        self,
        model_dir,
        stages: int,
        scheduling: str = "async",
        kv_cache_memory: str = "128MiB",
        max_model_len: int = 1024,
        worker_args: list[str] | None = None,
        scheduler_args: list[str] | None = None,
        redis_url: str | None = None,
        security: ClientSecurity | None = None,
        tensor_parallel_size: int = 1,
    ):
        """`security`: how this harness reaches the scheduler (TLS, internal token) when the
        worker and scheduler args turn credentials on. `tensor_parallel_size`: ranks per
        stage; workers are then indexed stage-major (worker i = stage i // T, rank i % T)."""
        self.model_dir, self.stages, self.scheduling = str(model_dir), stages, scheduling
        self.tp_size = tensor_parallel_size
        num_workers = stages * tensor_parallel_size
        self.kv_cache_memory = kv_cache_memory
        self.worker_args = ["--max-model-len", str(max_model_len), *(worker_args or [])]
        self.scheduler_args = scheduler_args or []
        self.redis = None if redis_url else RedisServer().start()
        self.redis_url = redis_url or self.redis.url
        self.dist_addr = f"127.0.0.1:{free_port()}"
        self.worker_ports = [free_port() for _ in range(num_workers)]
        self.scheduler_port = free_port()
        self.workers: list[subprocess.Popen | None] = [None] * num_workers
        self.scheduler: subprocess.Popen | None = None
        self._channel = None
        self.security = security or ClientSecurity()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.scheduler_port}"

    def start(self, timeout_s: float = 180) -> ProcessStack:
        try:
            for index in range(len(self.workers)):
                self.start_worker(index)
            self.start_scheduler(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def start_worker(self, index: int) -> None:
        """Starts worker `index`: the stage's index without tensor parallelism."""
        stage, tp_rank = divmod(index, self.tp_size)
        argv = [
            "worker",
            "--model",
            self.model_dir,
            "--stage",
            str(stage),
            "--stages",
            str(self.stages),
            "--dist-addr",
            self.dist_addr,
            "--port",
            str(self.worker_ports[index]),
            "--kv-cache-memory",
            self.kv_cache_memory,
            "--threads",
            "1",
            *self.worker_args,
        ]
        if self.tp_size > 1:
            argv += ["--tensor-parallel-size", str(self.tp_size), "--tp-rank", str(tp_rank)]
        self.workers[index] = _spawn(argv)

    def start_scheduler(self, timeout_s: float = 180) -> None:
        workers = ",".join(f"127.0.0.1:{p}" for p in self.worker_ports)
        argv = [
            "scheduler",
            "--workers",
            workers,
            "--redis-url",
            self.redis_url,
            "--port",
            str(self.scheduler_port),
            "--scheduling",
            self.scheduling,
            *self.scheduler_args,
        ]
        self.scheduler = _spawn(argv)
        deadline = time.monotonic() + timeout_s
        while True:
            for index, proc in enumerate(self.workers):
                if proc is not None and proc.poll() is not None:
                    raise RuntimeError(f"worker {index} exited with {proc.returncode}")
            try:
                wait_serving(self.address, 2.0, self.scheduler, security=self.security)
                return
            except TimeoutError:
                if time.monotonic() > deadline:
                    raise

    def kill_worker(self, index: int) -> None:
        _kill(self.workers[index])
        self.workers[index] = None

    def kill_scheduler(self) -> None:
        _kill(self.scheduler)
        self.scheduler = None
        self.close_channel()

    def stop(self) -> None:
        self.close_channel()
        for proc in [self.scheduler, *self.workers]:
            if proc is not None and proc.poll() is None:
                proc.terminate()
        for proc in [self.scheduler, *self.workers]:
            if proc is not None:
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        if self.redis:
            self.redis.stop()

    # -- client -----------------------------------------------------------------------
    @property
    def stub(self) -> scheduler_pb2_grpc.SchedulerStub:
        if self._channel is None:
            self._channel = self.security.sync_channel(self.address)
        return scheduler_pb2_grpc.SchedulerStub(self._channel)

    def close_channel(self) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = None

    def generate(self, prompt: list[int], request_id: str | None = None, **sampling) -> Outcome:
        sampling.setdefault("max_tokens", 16)
        request = scheduler_pb2.SubmitRequest(
            request_id=request_id or f"req-{next(_ids)}-{time.time_ns()}",
            prompt_token_ids=prompt,
            sampling=common_pb2.SamplingParams(**sampling),
        )
        outcome = Outcome([], 0)
        metadata = self.security.with_metadata(None)
        for delta in self.stub.Submit(request, timeout=300, metadata=metadata):
            assert delta.offset == len(outcome.token_ids), "a delta skipped or repeated tokens"
            outcome.token_ids.extend(delta.token_ids)
            outcome.offsets.append(delta.offset)
            outcome.finish_reason = delta.finish_reason
        return outcome

    def generate_many(
        self,
        prompts: list[list[int]],
        samplings: list[dict] | None = None,
        delays: list[float] | None = None,
    ) -> list[Outcome]:
        """All at once (or staggered by `delays` seconds), each on its own stream."""
        samplings = samplings or [{} for _ in prompts]
        delays = delays or [0.0] * len(prompts)

        def run(i):
            time.sleep(delays[i])
            return self.generate(prompts[i], **samplings[i])

        with concurrent.futures.ThreadPoolExecutor(max_workers=len(prompts)) as pool:
            return list(pool.map(run, range(len(prompts))))

    def stats(self) -> scheduler_pb2.SchedulerStats:
        metadata = self.security.with_metadata(None)
        return self.stub.GetStats(scheduler_pb2.GetStatsRequest(), timeout=30, metadata=metadata)


def _spawn(argv: list[str]) -> subprocess.Popen:
    log_level = os.environ.get("CONVEYOR_TEST_LOG", "WARNING")
    cmd = [sys.executable, "-m", "services.cli", "--log-level", log_level, *argv]
    return subprocess.Popen(cmd, env=child_env())


def _kill(proc: subprocess.Popen | None) -> None:
    if proc is not None and proc.poll() is None:
        proc.kill()
        proc.wait()


def wait_until(predicate, timeout_s: float = 60.0, interval_s: float = 0.2) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(interval_s)
    raise AssertionError(f"condition not met within {timeout_s} s")

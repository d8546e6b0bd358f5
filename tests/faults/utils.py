"""A `conveyor up` stack (tiny model, 2 stages, async) over a Redis the test controls, the
processes it supervises, and many concurrent streams through its router.

Faults are injected for real: SIGKILL of a child of `conveyor up` (found through /proc),
SIGKILL / SIGSTOP of redis-server, and a restart of Redis from an older RDB snapshot.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.proto.conveyor.v1 import (
    common_pb2,
    generation_pb2,
    generation_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
)
from services.common.redis_server import find_redis_server, free_port
from services.models.tiny import make_tiny_model

ROOT = Path(__file__).resolve().parents[2]
SERVING = health_pb2.HealthCheckResponse.SERVING


class RedisProcess:
    """redis-server on a fixed port and directory, with an RDB file that SAVE writes and a
    restart loads (unless `fresh`): kill, pause and restart it like an operator's bad day."""

    def __init__(self, workdir: Path):
        self.port = free_port()
        self.workdir = workdir
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url, socket_timeout=5)

    def start(self, fresh: bool = False) -> RedisProcess:
        dump = self.workdir / "dump.rdb"
        if fresh:
            dump.unlink(missing_ok=True)
        cmd = [find_redis_server(), "--port", str(self.port), "--bind", "127.0.0.1"]
        cmd += ["--save", "", "--appendonly", "no", "--dir", str(self.workdir)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_until(self._answers, 10)
        return self

    def _answers(self) -> bool:
        try:
            return self.client().ping()
        except redis.RedisError:
            return False

    def save(self) -> None:
        """An RDB snapshot of now, which the next `start()` loads."""
        self.client().save()

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()

    def pause(self) -> None:
        self.proc.send_signal(signal.SIGSTOP)

    def cont(self) -> None:
        self.proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.cont()
            self.proc.kill()
            self.proc.wait()


@dataclass
class Outcome:
    """What one stream received: every token in order, and how it ended."""

    request_id: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: int = 0
    error: grpc.StatusCode | None = None
    details: str = ""
    """The error's message (shown when a test fails on it)."""
    offsets_ok: bool = True
    """Every delta started where the previous one ended (no gap, no duplicate)."""


class UpStack:
    """`conveyor up` as a child process, over `redis` (the test's)."""

    def __init__(
        self,
        model_dir: Path,
        redis_proc: RedisProcess,
        log: Path,
        *scheduler_args: str,
        up_args: tuple[str, ...] = (),
    ):
        self.port, self.scheduler_port = free_port(), free_port()
        argv = [sys.executable, "-m", "services.cli", "up", "--no-http", "--model", str(model_dir)]
        argv += ["--stages", "2", "--threads", "1", "--kv-cache-memory", "32MiB"]
        argv += ["--port", str(self.port), "--scheduler-port", str(self.scheduler_port)]
        argv += ["--redis-url", redis_proc.url, "--max-restarts", "20"]
        argv += [f"--scheduler-arg={a}" for a in scheduler_args]
        argv += up_args
        self.log = log.open("w")
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=self.log, stderr=self.log)
        self.router = f"127.0.0.1:{self.port}"
        self.scheduler = f"127.0.0.1:{self.scheduler_port}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()

    # -- the children -------------------------------------------------------------------
    def child_pid(self, kind: str) -> int:
        """The pid of the live child `kind`: "router", "scheduler", "worker 0", "worker 1",
        "worker draft" (the draft worker of a draft-model speculative config)."""
        words = kind.split()
        for pid in _children(self.proc.pid):
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            args = [a.decode() for a in cmdline]
            if words[0] not in args:
                continue
            if len(words) == 1 or (words[1] == "draft" and "--draft" in args):
                return pid
            if "--stage" in args and args[args.index("--stage") + 1] == words[1]:
                return pid
        raise LookupError(f"no live {kind} under conveyor up")

    def kill(self, kind: str, sig: signal.Signals = signal.SIGKILL) -> int:
        pid = self.child_pid(kind)
        os.kill(pid, sig)
        return pid

    # -- health and state ---------------------------------------------------------------
    def health(self, address: str, timeout_s: float = 1.0) -> int | None:
        """The health status, or None when the service does not answer."""
        with grpc.insecure_channel(address) as channel:
            try:
                stub = health_pb2_grpc.HealthStub(channel)
                return stub.Check(health_pb2.HealthCheckRequest(), timeout=timeout_s).status
            except grpc.RpcError:
                return None

    def wait_serving(self, timeout_s: float = 120) -> None:
        """Until `conveyor up` said it serves (so it supervises every child), and the
        scheduler and the router answer SERVING."""
        log = Path(self.log.name)
        wait_until(lambda: "conveyor is serving" in log.read_text(), timeout_s)
        wait_until(
            lambda: self.health(self.scheduler) == SERVING and self.health(self.router) == SERVING,
            timeout_s,
        )

    def stats(self) -> scheduler_pb2.SchedulerStats:
        with grpc.insecure_channel(self.scheduler) as channel:
            stub = scheduler_pb2_grpc.SchedulerStub(channel)
            return stub.GetStats(scheduler_pb2.GetStatsRequest(), timeout=10)

    def wait_idle(self, timeout_s: float = 60) -> scheduler_pb2.SchedulerStats:
        """Waits until no request is left and every KV block is free; returns the stats."""

        def idle() -> bool:
            try:
                stats = self.stats()
            except grpc.RpcError:
                return False
            return (
                stats.num_running == 0
                and stats.num_waiting == 0
                and stats.num_free_blocks == stats.num_blocks
            )

        wait_until(idle, timeout_s)
        return self.stats()

    # -- streams ------------------------------------------------------------------------
    def stream(self, prompt_ids: list[int], max_tokens: int, out: Outcome, **fields) -> None:
        """One Generate stream through the router, recorded into `out`."""
        generate(self.router, prompt_ids, max_tokens, out, **fields)

    def run_streams(
        self, prompts: list[list[int]], max_tokens: int, fault=None, after_tokens: int = 0
    ) -> list[Outcome]:
        """Streams every prompt at once; calls `fault()` once the streams together received
        `after_tokens` tokens (mid-run), then waits for all of them to end."""
        return run_streams(self.router, prompts, max_tokens, fault, after_tokens)


def generate(router: str, prompt_ids: list[int], max_tokens: int, out: Outcome, **fields) -> None:
    """One greedy Generate stream through `router`, recorded into `out`."""
    request = generation_pb2.GenerateRequest(
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        **fields,
    )
    request.token_ids.ids.extend(prompt_ids)
    with grpc.insecure_channel(router) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        try:
            for msg in stub.Generate(request, timeout=300):
                out.request_id = msg.request_id
                out.offsets_ok &= msg.offset == len(out.token_ids)
                out.token_ids.extend(msg.token_ids)
                out.finish_reason = msg.finish_reason
        except grpc.RpcError as exc:
            out.error = exc.code()
            out.details = exc.details() or ""


def run_streams(
    router: str,
    prompts: list[list[int]],
    max_tokens: int,
    fault=None,
    after_tokens: int = 0,
    fault_wait_s: float = 120,
) -> list[Outcome]:
    """Streams every prompt at once through `router`; calls `fault()` once every stream was
    accepted (its first message arrived) and together they received `after_tokens` tokens,
    then waits for all of them to end. A stream that the fault met before its Submit reached
    the scheduler would rightly be refused (UNAVAILABLE while Redis is down), which is not
    what these tests check: what was accepted is neither lost nor duplicated."""
    outcomes = [Outcome() for _ in prompts]
    threads = [
        threading.Thread(target=generate, args=(router, p, max_tokens, o), daemon=True)
        for p, o in zip(prompts, outcomes, strict=True)
    ]
    for thread in threads:
        thread.start()
    if fault is not None:
        wait_until(
            lambda: (
                all(o.request_id or o.error for o in outcomes)
                and sum(len(o.token_ids) for o in outcomes) >= after_tokens
            ),
            fault_wait_s,
        )
        fault()
    for thread in threads:
        thread.join(timeout=300)
    assert not any(t.is_alive() for t in threads), "a stream never ended"
    return outcomes


def _children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            found.append(int(stat.parent.name))
    return found


def redis_leftovers(client: redis.Redis) -> list[str]:
    """Keys that would outlive their TTL: request keys without an expiry, and a non-empty
    index of unfinished requests."""
    bad = []
    for key in client.scan_iter(count=1000):
        name = key.decode()
        if name == "conveyor:unfinished":
            if client.zcard(key):
                bad.append(f"{name} lists {client.zrange(key, 0, 5)}")
        elif name.startswith("{req:") and client.ttl(key) < 0:
            bad.append(f"{name} has no TTL")
    return bad


def wait_until(predicate, timeout_s: float, interval_s: float = 0.1) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(interval_s)
    raise AssertionError(f"condition not met within {timeout_s} s")


@contextmanager
def serving_stack(
    tmp_path_factory,
    redis_proc: RedisProcess,
    model: Path | None = None,
    up_args: tuple[str, ...] = (),
):
    """An `UpStack` of `model` (default: a new tiny one) over `redis_proc`, serving;
    `up_args`: more `conveyor up` flags. Its log is printed when the block fails."""
    if model is None:
        model = make_tiny_model(tmp_path_factory.mktemp("tiny") / "m", tie_word_embeddings=False)
    log = tmp_path_factory.mktemp("up") / "up.log"
    # A stage with steps in flight and none finished for 10 s is hung (the tiny model's
    # steps take milliseconds; the default 60 s would make the hung-stage test long).
    stack = UpStack(model, redis_proc, log, "--store-grace=1", "--step-timeout=10", up_args=up_args)
    try:
        stack.wait_serving()
        yield stack
    except BaseException:
        print(log.read_text()[-8000:])
        raise
    finally:
        stack.stop()

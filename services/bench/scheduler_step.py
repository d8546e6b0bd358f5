"""Scheduler planning time per step (pure Python) and Redis round trips / latency per step.

    .venv/bin/python -m services.bench.scheduler_step [--steps 2000]

Scenarios:
* `decode-256`: 256 running requests, every one decoding each step (P=1: the worst case,
  all of them in every plan);
* `mix-32+4x512`: 32 decodes plus 4 prefill chunks of 512 tokens per step;
* `redis`: the decode scenario with a private redis-server: round trips and latency of the
  per-step flush (process_result) against it;
* `p8-256`: the control plane's whole CPU work per plan at P = 8, async (2P steps in flight),
  256 running requests (32 per micro-batch), Redis on: plan, encode the StepPlan, process
  the result (one Redis round trip), encode the deltas as a session's message. Its inverse
  is the plan rate the scheduler sustains on one core before gRPC writes (each plan is
  written to 8 stages; a write costs ~0.03-0.1 ms here, see docs/performance.md).
"""

from __future__ import annotations

import argparse
import collections
import random
import shutil
import socket
import statistics
import subprocess
import tempfile
import time

from services.common.sampling import SamplingParams
from services.common.step import StepResult
from services.scheduler.config import SchedulerConfig
from services.scheduler.request import Request
from services.scheduler.scheduler import Scheduler


def _request(request_id: str, prompt_len: int, max_tokens: int) -> Request:
    # Seeded by the id: the same prompts in every run, and no two alike. (They were
    # hash((id, i)) % 30000, randomized per process; for ~1 pair of ids in 30,000 the two
    # hashes differ by a multiple of 30,000 for every i, so whole prompts repeated, hit the
    # prefix cache, and the mix scenario's token count assertion failed now and then.)
    rng = random.Random(request_id)
    prompt = [rng.randrange(1, 30001) for _ in range(prompt_len)]
    return Request(request_id, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def _result(plan) -> StepResult:
    ids = [r.request_id for r in plan.new_requests + plan.cached_requests]
    return StepResult(plan.step_id, ids, [5] * len(ids))


def _percentiles(samples_s: list[float]) -> str:
    us = sorted(s * 1e6 for s in samples_s)
    p50, p99 = us[len(us) // 2], us[int(len(us) * 0.99)]
    return f"p50 {p50:8.1f} us   p99 {p99:8.1f} us   mean {statistics.fmean(us):8.1f} us"


def bench_decode(num_steps: int, scheduling: str, store=None) -> tuple[list[float], list[float]]:
    config = SchedulerConfig(
        num_blocks=65536,
        block_size=16,
        max_num_seqs=256,
        max_num_batched_tokens=8192,
        max_model_len=4096,
        scheduling=scheduling,
        num_stages=1,
    )
    scheduler = Scheduler(config, store)
    for i in range(256):
        scheduler.add_request(_request(f"d{i}", 128, 1_000_000))
    for _ in range(8):  # prefill everyone (4 steps of 64 prompts): now all decoding
        scheduler.process_result(_result(scheduler.schedule()))
    plan_s, flush_s = [], []
    for _ in range(num_steps):
        t0 = time.perf_counter()
        plan = scheduler.schedule()
        t1 = time.perf_counter()
        scheduler.process_result(_result(plan))
        t2 = time.perf_counter()
        assert plan.num_requests == 256, (plan.step_id, plan.num_requests)
        plan_s.append(t1 - t0)
        flush_s.append(t2 - t1)
    return plan_s, flush_s


def bench_mix(num_steps: int) -> list[float]:
    """32 decodes + 4 prefill chunks of 512 tokens (new long prompts keep arriving)."""
    config = SchedulerConfig(
        num_blocks=65536,
        block_size=16,
        max_num_seqs=64,
        max_num_batched_tokens=32 + 4 * 512,
        max_model_len=8192,
        num_stages=1,
        max_waiting=100_000,
    )
    scheduler = Scheduler(config)
    for i in range(32):
        scheduler.add_request(_request(f"d{i}", 64, 1_000_000))
    scheduler.process_result(_result(scheduler.schedule()))
    samples, counter = [], 0
    for _ in range(num_steps):
        while scheduler.num_waiting < 4:  # 4 long prompts of 512 tokens each, 1 chunk each
            scheduler.add_request(_request(f"p{counter}", 512, 1))
            counter += 1
        t0 = time.perf_counter()
        plan = scheduler.schedule()
        samples.append(time.perf_counter() - t0)
        assert plan.num_scheduled_tokens == 32 + 4 * 512, plan.num_scheduled_tokens
        scheduler.process_result(_result(plan))
    return samples


def bench_pipeline(num_plans: int, store, num_stages: int = 8) -> tuple[list[float], float]:
    """(CPU seconds (process time) per plan, mean requests per plan) in the `p8-256`
    scenario."""
    from services.common.pb import plan_to_pb
    from services.common.proto.conveyor.v1 import scheduler_pb2
    from services.scheduler.session import delta_to_pb

    config = SchedulerConfig(
        num_blocks=65536,
        block_size=16,
        max_num_seqs=256,
        max_num_batched_tokens=2048,  # the GPU step budget (conveyor up --device sim, h200)
        max_model_len=4096,
        scheduling="async",
        num_stages=num_stages,
    )
    scheduler = Scheduler(config, store)
    for i in range(256):
        scheduler.add_request(_request(f"p{i}", 128, 1_000_000))
    inflight: collections.deque = collections.deque()
    samples, num_tokens = [], 0
    for step in range(num_plans + 64):  # the first 64: prefill, then all decoding
        t0 = time.process_time()
        while len(inflight) < config.steps_in_flight:
            plan = scheduler.schedule()
            if not plan.num_requests:
                break
            plan_to_pb(plan, True).SerializeToString()
            inflight.append(plan)
        done = inflight.popleft()
        deltas = scheduler.process_result(_result(done))
        response = scheduler_pb2.SessionResponse()
        for n, delta in enumerate(deltas):
            delta_to_pb(delta, response.updates.add(stream_id=n + 1).delta)
        response.SerializeToString()
        if step >= 64:
            samples.append(time.process_time() - t0)
            num_tokens += done.num_requests
    return samples, num_tokens / num_plans


def _start_redis() -> tuple[subprocess.Popen, str]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.Popen(
        [
            shutil.which("redis-server"),
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            tempfile.mkdtemp(),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    for _ in range(200):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            break
        except OSError:
            time.sleep(0.05)
    return proc, f"redis://127.0.0.1:{port}/0"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    args = parser.parse_args()
    for scheduling in ("async", "sync"):
        plan_s, _ = bench_decode(args.steps, scheduling)
        print(f"decode-256 ({scheduling:5s}) schedule(): {_percentiles(plan_s)}")
    print(f"mix-32+4x512 schedule():       {_percentiles(bench_mix(args.steps))}")
    if shutil.which("redis-server") is None:
        print("redis: skipped (redis-server not on PATH)")
        return
    from services.scheduler.store import RedisStateStore

    proc, url = _start_redis()
    try:
        store = RedisStateStore(url)
        steps = min(args.steps, 1000)
        before = store.round_trips
        plan_s, flush_s = bench_decode(steps, "async", store)
        trips = (store.round_trips - before - 256 - 8) / steps  # minus the adds and warm-up
        print(f"redis decode-256 schedule():   {_percentiles(plan_s)}")
        print(f"redis decode-256 process_result() incl. flush: {_percentiles(flush_s)}")
        print(f"redis round trips per step: {trips:.2f}")
        plan_s, per_plan = bench_pipeline(steps, store)
        mean = statistics.fmean(plan_s)
        print(
            f"p8-256 (redis) CPU per plan:   {_percentiles(plan_s)}   "
            f"({per_plan:.0f} requests per plan) -> {1 / mean:.0f} plans/s on one core"
        )
    finally:
        proc.terminate()
        proc.wait(timeout=10)


if __name__ == "__main__":
    main()

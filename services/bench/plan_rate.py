"""The scheduler's sustained plan rate: the real scheduler process, Redis on, async, P stages
that answer at once.

    python -m services.bench.plan_rate [--stages 8] [--num-requests 256] [--seconds 10]

Starts a private redis-server, P null stages in one helper process and `conveyor scheduler
--workers ... --redis-url ...`, then submits the requests on one `Scheduler.Session`, as a
router does (128-token prompts, ignore_eos and a max_tokens that keeps every one running),
and reads every delta. `--max-num-seqs` is requests / P (32 at P = 8), the micro-batch a
pipeline of stages that take time settles to. A null stage is a real `StageWorker` gRPC server that keeps the
bookkeeping of which request samples and reports token 5 at once: no model, no wait, so
the pipeline turns as fast as the scheduler plans (the issue's "P = 8 with ~2-5 ms stage
steps" needs 500 plans/s). Over a window of `--seconds` it reports plans/s and the
scheduler process's CPU per plan (GetStats). The stages, Redis and this client are cheap
but share the machine's cores with the scheduler: on a loaded machine the CPU per plan is
the figure that carries over (one core sustains 1 / CPU per plan).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import subprocess
import sys
import time

import grpc

from services.common.proto.conveyor.v1 import (
    common_pb2,
    scheduler_pb2,
    scheduler_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)
from services.common.redis_server import free_port
from services.common.step import SESSION_ACCEPTED

_TOKEN = 5
_MAX_MODEL_LEN = 8192


class NullStage(worker_pb2_grpc.StageWorkerServicer):
    """Stage `stage` of `num_stages`; the last one reports a token for every request that
    completes its prompt or decodes in a plan, the moment the plan arrives."""

    def __init__(self, stage: int, num_stages: int):
        self.stage, self.num_stages = stage, num_stages

    async def Describe(self, request, context):
        return worker_pb2.DescribeResponse(
            stage=self.stage,
            num_stages=self.num_stages,
            num_kv_blocks=200_000,
            block_size=16,
            ready=True,
            model_name="null",
            max_model_len=_MAX_MODEL_LEN,
            vocab_size=32_000,
            eos_token_ids=[2],
            device="cuda",  # the GPU step budget, as a simulated h200 stage reports
            tensor_parallel_size=1,
        )

    async def GetTimeline(self, request, context):
        return worker_pb2.Timeline()

    async def Run(self, request_iterator, context):
        is_last = self.stage == self.num_stages - 1
        # as a worker does: the scheduler serves only once every stage took the session
        await context.send_initial_metadata(((SESSION_ACCEPTED, "1"),))
        prompt_len: dict[str, int] = {}
        computed: dict[str, int] = {}
        async for msg in request_iterator:
            following = msg.following if "following" in msg.DESCRIPTOR.fields_by_name else ()
            for plan in (msg, *following):
                for request_id in plan.finished_request_ids:
                    prompt_len.pop(request_id, None)
                    computed.pop(request_id, None)
                sampled = []
                for r in plan.new_requests:
                    prompt_len[r.request_id] = r.num_prompt_tokens
                    computed[r.request_id] = r.num_computed_tokens + r.num_scheduled_tokens
                    if computed[r.request_id] >= len(r.token_ids):
                        sampled.append(r.request_id)
                for r in plan.cached_requests:
                    computed[r.request_id] += r.num_scheduled_tokens
                    if computed[r.request_id] >= prompt_len[r.request_id]:
                        sampled.append(r.request_id)
                for request_id in plan.decode_request_ids:  # past their prompts: sample
                    computed[request_id] += 1
                    sampled.append(request_id)
                if is_last:
                    yield worker_pb2.StepReport(
                        step_id=plan.step_id,
                        stage=self.stage,
                        request_ids=sampled,
                        token_ids=[_TOKEN] * len(sampled),
                    )


async def serve_stages(ports: list[int]) -> None:
    servers = []
    for stage, port in enumerate(ports):
        server = grpc.aio.server(options=[("grpc.max_receive_message_length", 64 << 20)])
        worker_pb2_grpc.add_StageWorkerServicer_to_server(NullStage(stage, len(ports)), server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        servers.append(server)
    await asyncio.gather(*(s.wait_for_termination() for s in servers))


class Client:
    """One Session with every request on it; counts the tokens that come back."""

    def __init__(self, address: str):
        self.channel = grpc.aio.insecure_channel(address)
        self.stub = scheduler_pb2_grpc.SchedulerStub(self.channel)
        self.num_tokens = 0
        self.errors: list[str] = []
        self._commands: asyncio.Queue = asyncio.Queue()

    async def _requests(self):
        while (command := await self._commands.get()) is not None:
            yield command

    async def run(self, num_requests: int, prompt_len: int) -> None:
        for i in range(num_requests):
            submit = scheduler_pb2.SubmitRequest(
                request_id=f"r{i}",
                prompt_token_ids=[(i * 7919 + j) % 30_000 + 10 for j in range(prompt_len)],
                sampling=common_pb2.SamplingParams(
                    max_tokens=_MAX_MODEL_LEN - prompt_len, ignore_eos=True
                ),
            )
            self._commands.put_nowait(scheduler_pb2.SessionRequest(stream_id=i + 1, submit=submit))
        async for response in self.stub.Session(self._requests()):
            for update in response.updates:
                self.num_tokens += len(update.delta.token_ids)
                if update.status_code:
                    self.errors.append(update.status_message)

    async def stats(self) -> scheduler_pb2.SchedulerStats:
        return await self.stub.GetStats(scheduler_pb2.GetStatsRequest(), timeout=30)


def _profile(pid: int, args: argparse.Namespace) -> subprocess.Popen | None:
    """py-spy on the scheduler over the window (`--py-spy FILE`: a speedscope profile).
    Non-blocking: py-spy pausing the process at each sample cut the rate it measures ~6x."""
    if not args.py_spy:
        return None
    py_spy = shutil.which("py-spy", path=os.path.dirname(sys.executable)) or "py-spy"
    return subprocess.Popen(
        [py_spy, "record", "-p", str(pid), "-r", "250", "--nonblocking"]
        + ["-d", str(int(args.seconds)), "--format", "speedscope", "-o", args.py_spy],
        stdout=subprocess.DEVNULL,
    )


async def measure(address: str, pid: int, args: argparse.Namespace) -> dict:
    client = Client(address)
    deadline = time.monotonic() + 120
    while True:  # until the scheduler serves (the pipeline is whole)
        try:
            if (await client.stats()).serving:
                break
        except grpc.RpcError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError("the scheduler did not become SERVING within 120 s")
        await asyncio.sleep(0.2)
    session = asyncio.create_task(client.run(args.num_requests, args.prompt_len))
    while (await client.stats()).num_running < args.num_requests:  # all admitted
        if client.errors or session.done():
            raise RuntimeError(f"submits failed: {client.errors[:3]} {session}")
        await asyncio.sleep(0.2)
    await asyncio.sleep(args.warmup)
    profiler = _profile(pid, args)
    start, t0, tokens0 = await client.stats(), time.monotonic(), client.num_tokens
    await asyncio.sleep(args.seconds)
    end, t1, tokens1 = await client.stats(), time.monotonic(), client.num_tokens
    session.cancel()
    if profiler is not None:
        await asyncio.to_thread(profiler.wait)
    await client.channel.close()
    num_plans = end.num_steps - start.num_steps
    cpu_s = end.cpu_seconds - start.cpu_seconds
    return {
        "plans_per_s": num_plans / (t1 - t0),
        "cpu_per_plan_ms": 1e3 * cpu_s / max(num_plans, 1),
        "scheduler_cpu_share": cpu_s / (t1 - t0),
        "tokens_per_plan": (tokens1 - tokens0) / max(num_plans, 1),
        "tokens_per_s": (tokens1 - tokens0) / (t1 - t0),
    }


def run(args: argparse.Namespace) -> dict:
    from services.bench.scheduler_step import _start_redis

    redis, redis_url = _start_redis()
    ports = [free_port() for _ in range(args.stages)]
    port = free_port()
    stages = subprocess.Popen(
        [sys.executable, "-m", __spec__.name, "--serve-stages", *map(str, ports)]
    )
    conveyor = shutil.which("conveyor", path=os.path.dirname(sys.executable)) or "conveyor"
    scheduler = subprocess.Popen(
        [
            conveyor,
            "scheduler",
            "--port",
            str(port),
            "--workers",
            ",".join(f"127.0.0.1:{p}" for p in ports),
            "--redis-url",
            redis_url,
            "--scheduling",
            "async",
            "--max-num-seqs",  # 32 per micro-batch at P = 8, as with stages that take time
            str(-(-args.num_requests // args.stages)),
        ]
    )
    try:
        return asyncio.run(measure(f"127.0.0.1:{port}", scheduler.pid, args))
    finally:
        for proc in (scheduler, stages, redis):
            proc.terminate()
        for proc in (scheduler, stages, redis):
            proc.wait(timeout=30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, default=8)
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--seconds", type=float, default=10.0, help="the measured window")
    parser.add_argument("--warmup", type=float, default=2.0, help="seconds before the window")
    parser.add_argument("--py-spy", metavar="FILE", help="profile the scheduler (speedscope)")
    parser.add_argument("--serve-stages", type=int, nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_stages:
        asyncio.run(serve_stages(args.serve_stages))
        return
    result = run(args)
    load = os.getloadavg()
    print(
        f"P={args.stages} {args.num_requests} running, Redis on, async: "
        f"{result['plans_per_s']:.0f} plans/s, {result['cpu_per_plan_ms']:.3f} ms scheduler CPU "
        f"per plan (1 core: {1e3 / result['cpu_per_plan_ms']:.0f} plans/s), "
        f"{result['tokens_per_plan']:.1f} tokens per plan, scheduler "
        f"{100 * result['scheduler_cpu_share']:.0f}% of a core; load average "
        f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f}"
    )


if __name__ == "__main__":
    main()

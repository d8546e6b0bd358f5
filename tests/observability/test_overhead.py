"""With metrics and tracing off, no metric is observed and no span object is created on the
step path of any service; with them on, the same run does both (so the counting works).

Counted by wrapping prometheus-client's and the OpenTelemetry SDK's entry points, never by
timing."""

from __future__ import annotations

import asyncio
from collections import Counter

import grpc
import pytest
import torch
from opentelemetry.sdk.trace import Tracer
from prometheus_client.metrics import Counter as PromCounter
from prometheus_client.metrics import Histogram

from services.common.pb import plan_to_pb, result_from_report
from services.common.proto.conveyor.v1 import worker_pb2, worker_pb2_grpc
from services.common.sampling import SamplingParams
from services.router import core as router_core
from services.router.core import RouterCore
from services.router.output import SchedulerDelta
from services.router.request import GenerateInput, ModelLimits
from services.router.tokenizer import Tokenizer
from services.scheduler import observability as scheduler_obs
from services.scheduler.config import PipelineInfo, SchedulerConfig
from services.scheduler.pipeline import StageReport
from services.scheduler.service import SchedulerService
from services.worker import observability as worker_obs
from services.worker.engine import StageEngine
from services.worker.server import StageWorkerServicer
from services.worker.transport import StageTransport
from tests.conftest import free_port
from tests.scheduler.utils import EOS, FakeWorkers
from tests.worker.utils import TinyPlanner, make_runners

TRACEPARENT = "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01"


@pytest.fixture
def calls(monkeypatch):
    """Counts of every metric observation, span start and event-trace line."""
    counts: Counter = Counter()

    def counting(cls, name):
        original = getattr(cls, name)

        def wrapper(self, *args, **kwargs):
            counts[f"{cls.__name__}.{name}"] += 1
            return original(self, *args, **kwargs)

        monkeypatch.setattr(cls, name, wrapper)

    counting(Histogram, "observe")
    counting(PromCounter, "inc")
    counting(Tracer, "start_span")
    counting(scheduler_obs.EventTrace, "_write")
    return counts


# -- scheduler ---------------------------------------------------------------------------
class FakePipeline:
    """Two stages played by FakeWorkers; every plan reports at once."""

    addresses = ["fake:0", "fake:1"]

    def __init__(self):
        self.reports: asyncio.Queue = asyncio.Queue()
        self.workers = FakeWorkers(is_async=True, block_size=4)

    async def wait_ready(self) -> PipelineInfo:
        return PipelineInfo(
            num_stages=2,
            num_blocks=64,
            block_size=4,
            max_model_len=128,
            vocab_size=64,
            model_name="fake",
            eos_token_ids=[EOS],
        )

    async def open(self) -> None:
        self.reports = asyncio.Queue()

    async def send(self, plan_bytes: bytes) -> None:
        from services.common.pb import plan_from_pb

        result = self.workers.run(plan_from_pb(worker_pb2.StepPlan.FromString(plan_bytes)))
        report = worker_pb2.StepReport(
            step_id=result.step_id,
            stage=1,
            request_ids=result.request_ids,
            token_ids=result.token_ids,
        )
        self.reports.put_nowait(StageReport(1, report))

    async def close(self) -> None:
        pass

    async def shutdown(self) -> None:
        pass


class FakeStore:
    round_trips = 0

    def add(self, request) -> None:
        pass

    def apply(self, updates) -> set[str]:
        return set()

    def check(self) -> None:
        pass

    def load_unfinished(self) -> list:
        return []


def run_scheduler(tmp_path, observed: bool) -> int:
    """Serves 3 requests of 5 tokens; returns the number of steps planned."""

    async def main():
        service = SchedulerService(SchedulerConfig(), FakePipeline(), FakeStore())
        close = lambda: None  # noqa: E731
        if observed:
            close = scheduler_obs.install(
                service,
                service.store,
                free_port(),
                f"file://{tmp_path}/spans.jsonl",
                str(tmp_path / "events.jsonl"),
            )
        await service.start()
        sampling = SamplingParams(max_tokens=5, ignore_eos=True)
        queues = [service.submit(f"r{i}", [20 + i] * 6, sampling) for i in range(3)]
        for queue in queues:
            while (await queue.get()).finish_reason is None:
                pass
        await service.stop()
        close()
        return service.counters.num_steps

    return asyncio.run(main())


def test_scheduler_does_no_observing_work_when_off(tmp_path, calls):
    num_steps = run_scheduler(tmp_path, observed=False)
    assert num_steps > 0
    assert sum(calls.values()) == 0


def test_scheduler_observes_every_step_when_on(tmp_path, calls):
    num_steps = run_scheduler(tmp_path, observed=True)
    assert calls["EventTrace._write"] >= num_steps  # a line per plan, more per transition
    assert calls["Tracer.start_span"] == 3 * 2  # a request span and a queue span each
    assert calls["Histogram.observe"] >= 3  # queue times


# -- router ------------------------------------------------------------------------------
class FakeSchedulerClient:
    def __init__(self):
        self.metadata = []

    async def stream(self, req, metadata=None):
        self.metadata.append(metadata)
        yield SchedulerDelta(offset=0, token_ids=[65, 66], num_prompt_tokens=len(req.prompt_ids))
        yield SchedulerDelta(offset=2, token_ids=[67], finish_reason="length")

    def abort(self, request_id, principal="", owner_token=""):
        pass


def run_router(model_dir, metrics=None, tracing=None) -> tuple[FakeSchedulerClient, list]:
    client = FakeSchedulerClient()
    core = RouterCore(
        tokenizer=Tokenizer.from_dir(model_dir),
        limits=ModelLimits(name="tiny", max_model_len=2048, vocab_size=512),
        scheduler=client,
        metrics=metrics,
        tracing=tracing,
    )

    async def main():
        req = await core.prepare(GenerateInput(sampling=SamplingParams(max_tokens=3), text="hi"))
        return [out async for out in core.generate(req)]

    return client, asyncio.run(main())


def test_router_does_no_observing_work_when_off(tiny_model_dir, calls, monkeypatch):
    built = []
    monkeypatch.setattr(router_core, "RequestObservation", lambda *a: built.append(a))
    client, outs = run_router(tiny_model_dir)
    assert outs[-1].finish_reason == "length"
    assert built == [] and client.metadata == [None]
    assert sum(calls.values()) == 0


def test_router_observes_and_propagates_when_on(tiny_model_dir, tmp_path, calls):
    from prometheus_client import CollectorRegistry

    from services.common.metrics import RouterMetrics
    from services.common.telemetry import make_tracing

    tracing = make_tracing(f"file://{tmp_path}/spans.jsonl", "conveyor-router")
    registry = CollectorRegistry()
    client, _ = run_router(tiny_model_dir, RouterMetrics(registry, "tiny"), tracing)
    tracing.shutdown()
    (metadata,) = client.metadata
    assert dict(metadata)["traceparent"].startswith("00-")
    assert calls["Tracer.start_span"] == 1
    assert (
        registry.get_sample_value("conveyor:generation_tokens_total", {"model_name": "tiny"}) == 3
    )
    assert (
        registry.get_sample_value(
            "conveyor:request_success_total", {"model_name": "tiny", "finished_reason": "length"}
        )
        == 1
    )


# -- worker ------------------------------------------------------------------------------
def run_worker(model_dir, servicer: StageWorkerServicer, trace_parent: str = "") -> int:
    """Runs two requests through one stage over a real Run stream; returns steps run."""
    runner = make_runners(model_dir, num_stages=1, block_size=16, num_blocks=32)[0]
    transport = StageTransport(0, 1, "127.0.0.1:0", torch.device("cpu"))
    servicer.set_engine(StageEngine(runner, transport), [EOS], 2048)
    planner = TinyPlanner(block_size=16, num_blocks=32)
    planner.add("a", [5, 6, 7, 8], max_new=4)
    planner.add("b", [9, 10], max_new=3)

    async def main():
        server = grpc.aio.server()
        worker_pb2_grpc.add_StageWorkerServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        num_steps = 0
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = worker_pb2_grpc.StageWorkerStub(channel).Run()
            while not planner.is_done:
                msg = plan_to_pb(planner.next_plan(), False)
                msg.trace_parent = trace_parent
                await call.write(msg)
                planner.apply(result_from_report(await call.read()))
                num_steps += 1
            await call.done_writing()
        await server.stop(None)
        return num_steps

    return asyncio.run(main())


def test_worker_does_no_observing_work_when_off(tiny_model_dir, calls):
    servicer = StageWorkerServicer(0, 1, "tiny")
    num_steps = run_worker(tiny_model_dir, servicer, trace_parent=TRACEPARENT)
    assert num_steps > 0 and servicer.observer is None
    assert sum(calls.values()) == 0


def test_worker_observes_every_step_when_on(tiny_model_dir, tmp_path, calls):
    servicer = StageWorkerServicer(0, 1, "tiny")
    close = worker_obs.install(servicer, 0, free_port(), f"file://{tmp_path}/spans.jsonl")
    num_steps = run_worker(tiny_model_dir, servicer, trace_parent=TRACEPARENT)
    close()
    assert calls["Histogram.observe"] == 4 * num_steps  # step, wait, batch size, batch tokens
    assert calls["Tracer.start_span"] == num_steps

"""The `--timeline` trace a scheduler writes on stop, from real StageWorker gRPC servers."""

from __future__ import annotations

import asyncio
import json
import logging

import grpc

from services.common.proto.conveyor.v1 import worker_pb2, worker_pb2_grpc
from services.scheduler.pipeline import Pipeline
from services.scheduler.server import write_timeline
from tests.conftest import free_port


class _Stage(worker_pb2_grpc.StageWorkerServicer):
    """A stage that answers GetTimeline with two steps."""

    def __init__(self, stage: int):
        self.stage = stage

    async def GetTimeline(self, request, context):
        steps = [
            worker_pb2.StepTiming(step_id=i, num_requests=1, start_ns=i * 10, end_ns=i * 10 + 5)
            for i in range(2)
        ]
        return worker_pb2.Timeline(stage=self.stage, steps=steps if request.include_steps else [])


async def _write_with_stage_1_gone(path) -> None:
    server = grpc.aio.server()
    worker_pb2_grpc.add_StageWorkerServicer_to_server(_Stage(0), server)
    port = free_port()
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    pipeline = Pipeline([f"127.0.0.1:{port}", f"127.0.0.1:{free_port()}"])  # nobody on stage 1
    try:
        await write_timeline(pipeline, str(path))
    finally:
        await pipeline.shutdown()
        await server.stop(None)


def test_write_timeline_keeps_the_stages_that_answer(tmp_path, caplog):
    path = tmp_path / "trace.json"
    with caplog.at_level(logging.WARNING):
        asyncio.run(_write_with_stage_1_gone(path))
    events = json.loads(path.read_text())["traceEvents"]
    assert {e["tid"] for e in events} == {0}
    assert [e["name"] for e in events if e["ph"] == "X"] == ["step 0", "step 1"]
    assert "stage 1's timeline is not in the trace: UNAVAILABLE" in caplog.text

"""int8 weights through the real stack: SmolLM2 on two worker processes (gloo, gRPC, Redis).

Sync and async scheduling give identical tokens with quantized weights, and every stage's
Describe says what it quantized.
"""

from __future__ import annotations

import grpc
import pytest

from services.common.proto.conveyor.v1 import worker_pb2, worker_pb2_grpc
from tests.integration.utils import ProcessStack

pytestmark = pytest.mark.slow

WORKER_ARGS = ["--quantization", "int8", "--dtype", "bfloat16"]
SAMPLINGS = [dict(max_tokens=8, ignore_eos=True)] * 4 + [
    dict(temperature=0.8, top_p=0.95, seed=2000 + i, max_tokens=8, ignore_eos=True)
    for i in range(2)
]


def _describe(port: int) -> worker_pb2.DescribeResponse:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = worker_pb2_grpc.StageWorkerStub(channel)
        return stub.Describe(worker_pb2.DescribeRequest(), timeout=10)


def test_int8_stack_sync_equals_async(smollm2_dir, smollm2_prompts):
    prompts = smollm2_prompts[:4] + smollm2_prompts[:2]
    tokens = {}
    for scheduling in ("sync", "async"):
        stack = ProcessStack(smollm2_dir, 2, scheduling, worker_args=WORKER_ARGS).start()
        try:
            outcomes = stack.generate_many(prompts, SAMPLINGS)
            tokens[scheduling] = [o.token_ids for o in outcomes]
            replies = [_describe(port) for port in stack.worker_ports]
        finally:
            stack.stop()
        assert [r.quantization for r in replies] == ["int8", "int8"]
    assert all(len(t) == 8 for t in tokens["sync"])
    assert tokens["sync"] == tokens["async"]

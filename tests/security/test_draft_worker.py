"""The draft worker (`conveyor worker --draft`) as a hostile caller meets it: a real process
with an internal token. Without the token nothing but health answers; with it, every
malformed Propose is refused with INVALID_ARGUMENT naming what is wrong, and the worker
keeps serving well-formed calls."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import grpc
import pytest

from services.client.client import ConveyorClient
from services.common.proto.conveyor.v1 import (
    draft_pb2,
    draft_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
    worker_pb2,
)
from services.launcher import wait_serving
from tests.conftest import free_port
from tests.processes import stop_process
from tests.security.utils import ROOT

TOKEN = "draft-test-token"
BEARER = (("authorization", f"Bearer {TOKEN}"),)
Seq = draft_pb2.DraftSequence


@pytest.fixture(scope="module")
def draft_stub(security_model_dir, tmp_path_factory):
    port = free_port()
    argv = [sys.executable, "-m", "services.cli", "worker", "--draft", "--host", "127.0.0.1"]
    argv += ["--model", str(security_model_dir), "--port", str(port), "--threads", "1"]
    argv += ["--kv-cache-memory", "8MiB"]
    log = tmp_path_factory.mktemp("draft") / "draft.log"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CONVEYOR_INTERNAL_TOKEN": TOKEN}
    with log.open("w") as out:
        proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=out, stderr=out)
    address = f"127.0.0.1:{port}"
    try:
        wait_serving(address, 300, proc)
        with grpc.insecure_channel(address) as channel:
            yield draft_pb2_grpc.DraftWorkerStub(channel)
    except BaseException:
        print(log.read_text()[-5000:], file=sys.stderr)
        raise
    finally:
        proc.kill()
        proc.wait()


def _propose(stub, *sequences: Seq, metadata=BEARER) -> draft_pb2.ProposeResponse:
    return stub.Propose(
        draft_pb2.ProposeRequest(sequences=sequences), metadata=metadata, timeout=60
    )


def test_draft_worker_refuses_callers_without_the_internal_token(draft_stub):
    for metadata in (None, (("authorization", "Bearer wrong"),)):
        with pytest.raises(grpc.RpcError) as err:
            _propose(
                draft_stub, Seq(request_id="a", token_ids=[1, 2], num_tokens=2), metadata=metadata
            )
        assert err.value.code() is grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as err:
            draft_stub.Describe(worker_pb2.DescribeRequest(), metadata=metadata, timeout=10)
        assert err.value.code() is grpc.StatusCode.UNAUTHENTICATED


@pytest.mark.parametrize(
    ("sequences", "message"),
    [
        ([Seq(request_id="a", token_ids=[1, 2], num_tokens=1000)], "num_tokens=1000"),
        ([Seq(request_id="a", token_ids=[1, 2], num_tokens=0)], "num_tokens=0"),
        ([Seq(request_id="a", token_ids=[1, 10**9], num_tokens=2)], "vocabulary"),
        ([Seq(request_id="a", token_ids=[1], num_tokens=2)] * 2, "appears twice"),
        ([Seq(request_id="", token_ids=[1], num_tokens=2)], "request id"),
        ([Seq(request_id="x" * 100_000, token_ids=[1], num_tokens=2)], "request id"),
        ([Seq(request_id="a\nWARNING forged", token_ids=[1], num_tokens=2)], "request id"),
    ],
)
def test_draft_worker_refuses_malformed_proposals(draft_stub, sequences, message):
    with pytest.raises(grpc.RpcError) as err:
        _propose(draft_stub, *sequences)
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert message in err.value.details() and len(err.value.details()) < 500
    # and it serves the next well-formed call (a scheduler's id: principal/id)
    reply = _propose(draft_stub, Seq(request_id="alice/r-1", token_ids=[5, 6, 7], num_tokens=2))
    assert [len(p.token_ids) for p in reply.proposals] == [2]


def test_draft_worker_answers_unknown_and_oversized_requests_without_failing(draft_stub):
    # start past what it holds: named unknown (the scheduler sends it whole)
    reply = _propose(
        draft_stub, Seq(request_id="ghost", start=1 << 31, token_ids=[1], num_tokens=2)
    )
    assert list(reply.unknown_request_ids) == ["ghost"]
    # longer than the draft model's context (256): no proposal, no error
    reply = _propose(draft_stub, Seq(request_id="long", token_ids=[3] * 5000, num_tokens=2))
    assert list(reply.proposals) == [] and list(reply.unknown_request_ids) == []


def test_draft_worker_takes_a_batch_as_large_as_a_stage_worker_does(draft_stub):
    """A scheduler's first call sends every candidate whole: 1,000 requests of 2,600 tokens
    is ~5 MB, past gRPC's default 4 MiB receive limit (a stage worker takes 64 MiB)."""
    sequences = [Seq(request_id=f"r{i}", token_ids=[300] * 2600, num_tokens=2) for i in range(1000)]
    reply = _propose(draft_stub, *sequences)  # past the context (256): no proposals
    assert list(reply.proposals) == [] and list(reply.unknown_request_ids) == []


@pytest.mark.slow
def test_up_gives_its_internal_token_to_the_draft_worker_and_the_scheduler(
    security_model_dir, tmp_path
):
    """With a token, a scheduler that did not present it to its draft worker would only
    ever fail its calls: speculation off, requests fine, nothing else to notice."""
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    spec = {"model": str(security_model_dir), "num_speculative_tokens": 3, "draft_timeout_s": 30}
    port, scheduler_port = free_port(), free_port()
    argv = [sys.executable, "-m", "services.cli", "up", "--no-http", "--stages", "1"]
    argv += ["--model", str(security_model_dir), "--speculative-config", json.dumps(spec)]
    argv += ["--port", str(port), "--scheduler-port", str(scheduler_port), "--threads", "1"]
    argv += ["--kv-cache-memory", "16MiB", "--cpu-affinity", "off"]
    argv += ["--internal-token-file", str(token_file)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONVEYOR_")}
    log = tmp_path / "up.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            argv, cwd=ROOT, env={**env, "PYTHONPATH": str(ROOT)}, stdout=out, stderr=out
        )
    try:
        wait_serving(f"127.0.0.1:{port}", 300, proc)
        with ConveyorClient(f"127.0.0.1:{port}", timeout_s=120) as client:
            result = client.complete("hello", max_tokens=16, ignore_eos=True)
        assert len(result.token_ids) == 16
        with grpc.insecure_channel(f"127.0.0.1:{scheduler_port}") as channel:
            stats = scheduler_pb2_grpc.SchedulerStub(channel).GetStats(
                scheduler_pb2.GetStatsRequest(), metadata=BEARER, timeout=30
            )
    except BaseException:
        print(log.read_text()[-5000:], file=sys.stderr)
        raise
    finally:
        stop_process(proc)
    assert stats.num_draft_calls > 0 and stats.num_draft_failures == 0, stats.draft_problem
    assert stats.num_spec_accepted_tokens > 0

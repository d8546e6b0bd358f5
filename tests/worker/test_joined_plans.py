"""Several plans in one Run message (`StepPlan.following`): what a busy scheduler's writer
sends. A real worker process (simulated device) runs each of them, in order."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import grpc
import pytest

from services.common.errors import PipelineUnavailable
from services.common.pb import plan_to_pb
from services.common.proto.conveyor.v1 import worker_pb2, worker_pb2_grpc
from services.common.redis_server import free_port
from services.common.sampling import SamplingParams
from services.common.step import CachedRequest, NewRequest, StepPlan
from services.scheduler.config import SchedulerConfig
from services.scheduler.pipeline import Pipeline, join_plans
from services.scheduler.service import SchedulerService
from services.scheduler.store import RedisStateStore
from services.worker.config import WorkerConfig
from services.worker.server import SESSION_WAIT_S
from services.worker.sim import MODELS_DIR
from services.worker.sim.runner import SimStageRunner

MODEL_DIR = MODELS_DIR / "llama-3-8b"
PROMPT = [10, 11, 12]
SAMPLING = SamplingParams(ignore_eos=True)


def _plans(tokens: list[int]) -> list[StepPlan]:
    """A prefill, then two decodes fed (sync mode) the tokens the sim samples."""
    return [
        StepPlan(0, new_requests=[NewRequest("a", PROMPT, 3, SAMPLING, [0], 0, 3)]),
        StepPlan(1, cached_requests=[CachedRequest("a", 1, [], [tokens[0]])]),
        StepPlan(2, cached_requests=[CachedRequest("a", 1, [], [tokens[1]])]),
    ]


def _joined(plans: list[StepPlan]) -> bytes:
    queue: asyncio.Queue[bytes] = asyncio.Queue()
    for plan in plans[1:]:
        queue.put_nowait(plan_to_pb(plan, False).SerializeToString())
    return join_plans(plan_to_pb(plans[0], False).SerializeToString(), queue)


def test_joined_plans_parse_as_the_first_with_the_rest_following():
    plans = _plans([7, 8])
    msg = worker_pb2.StepPlan.FromString(_joined(plans))
    assert [p.step_id for p in (msg, *msg.following)] == [0, 1, 2]
    assert all(not p.following for p in msg.following)
    assert msg.following[1].decode_request_ids == ["a"]  # a plain decode: the columns
    assert msg.following[1].decode_token_ids == [8]
    assert msg.new_requests[0].token_ids == PROMPT


@pytest.fixture(scope="module")
def worker():
    port = free_port()
    argv = ["worker", "--model", str(MODEL_DIR), "--device", "sim", "--sim-profile", "h100"]
    argv += ["--stage", "0", "--stages", "1", "--port", str(port), "--max-model-len", "512"]
    argv += ["--dist-addr", f"127.0.0.1:{free_port()}", "--host", "127.0.0.1"]
    proc = subprocess.Popen([sys.executable, "-m", "services.cli", *argv])
    address = f"127.0.0.1:{port}"
    try:
        wait_ready(address, proc)
        yield address
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def wait_ready(address: str, proc: subprocess.Popen, timeout_s: float = 120) -> None:
    """Until the worker process `proc` at `address` has loaded its stage."""
    deadline = time.monotonic() + timeout_s
    while not _ready(address):
        assert proc.poll() is None, f"the worker exited with {proc.returncode}"
        assert time.monotonic() < deadline, f"the worker did not become ready in {timeout_s} s"
        time.sleep(0.3)


def _ready(address: str) -> bool:
    with grpc.insecure_channel(address) as channel:
        stub = worker_pb2_grpc.StageWorkerStub(channel)
        try:
            return stub.Describe(worker_pb2.DescribeRequest(), timeout=2).ready
        except grpc.RpcError:
            return False


def _open_run(channel: grpc.aio.Channel, epoch: str | None = None):
    """A Run session (raw plan bytes out, reports in) with `epoch`, else a fresh one."""
    run = channel.stream_stream(
        "/conveyor.v1.StageWorker/Run",
        request_serializer=None,
        response_deserializer=worker_pb2.StepReport.FromString,
    )
    return run(metadata=(("conveyor-epoch", epoch or str(time.time_ns())),))


async def _run(address: str, messages: list[bytes], num_reports: int) -> list:
    async with grpc.aio.insecure_channel(address) as channel:
        call = _open_run(channel)
        for message in messages:
            await call.write(message)
        reports = []
        while len(reports) < num_reports:
            report = await asyncio.wait_for(call.read(), 60)
            if report is grpc.aio.EOF:  # the worker ended the session
                break
            reports.append(report)
        call.cancel()
        return reports


def test_worker_runs_every_plan_of_a_joined_message_in_order(worker):
    tokens = SimStageRunner.from_config(
        WorkerConfig(model_dir=str(MODEL_DIR), device="sim", sim_profile="h100")
    ).tokens.expected_tokens(PROMPT, SAMPLING, 3)
    reports = asyncio.run(_run(worker, [_joined(_plans(tokens))], 3))
    assert [r.error for r in reports] == ["", "", ""]
    assert [r.step_id for r in reports] == [0, 1, 2]
    assert [list(r.token_ids) for r in reports] == [[t] for t in tokens]


def test_worker_refuses_nested_plans(worker):
    inner = worker_pb2.StepPlan(step_id=1)
    inner.following.add(step_id=2)
    msg = worker_pb2.StepPlan(step_id=0, following=[inner])
    reports = asyncio.run(_run(worker, [msg.SerializeToString()], 2))
    assert [r.step_id for r in reports if "nests plans" in r.error] == [1]


def test_worker_reports_a_malformed_plan_rather_than_ending_silently(worker):
    bad = worker_pb2.StepPlan(step_id=1)
    request = bad.new_requests.add(request_id="b", token_ids=PROMPT, num_prompt_tokens=3)
    request.block_ids.append(1)
    request.num_scheduled_tokens = 3
    request.sampling.temperature = -1.0  # a peer's plan is validated like a client's request
    msg = worker_pb2.StepPlan(step_id=0, following=[bad])
    reports = asyncio.run(_run(worker, [msg.SerializeToString()], 2))
    errors = [(r.step_id, r.error) for r in reports if r.error]
    assert [s for s, e in errors if "malformed" in e and "temperature" in e] == [1], errors


def test_worker_refuses_a_step_id_that_does_not_increase(worker):
    msg = worker_pb2.StepPlan(step_id=5, following=[worker_pb2.StepPlan(step_id=3)])
    reports = asyncio.run(_run(worker, [msg.SerializeToString()], 2))
    assert [r.step_id for r in reports if "came after step 5" in r.error] == [3]


def test_worker_refuses_decode_columns_that_disagree(worker):
    bad = worker_pb2.StepPlan(step_id=1, decode_request_ids=["a", "b"], decode_token_ids=[7])
    msg = worker_pb2.StepPlan(step_id=0, following=[bad])
    reports = asyncio.run(_run(worker, [msg.SerializeToString()], 2))
    errors = [(r.step_id, r.error) for r in reports if r.error]
    assert [s for s, e in errors if "1 decode_token_ids for 2" in e] == [1], errors


def test_a_second_schedulers_session_is_refused_while_the_first_runs(worker):
    """A --workers list that names a stage another scheduler drives: the second Run waits
    SESSION_WAIT_S for the first session to end, then is refused naming the cause (it
    waited forever, its scheduler SERVING with plans nobody read). Once the first session
    ends, a new one is taken."""

    async def main():
        async with grpc.aio.insecure_channel(worker) as channel:
            first = _open_run(channel)
            await first.write(worker_pb2.StepPlan(step_id=0).SerializeToString())
            second = _open_run(channel)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await asyncio.wait_for(second.read(), SESSION_WAIT_S + 60)
            first.cancel()
        return refused.value

    refused = asyncio.run(main())
    assert refused.code() is grpc.StatusCode.UNAVAILABLE
    assert "serves another scheduler's session" in refused.details()
    bad = worker_pb2.StepPlan(step_id=5, following=[worker_pb2.StepPlan(step_id=3)])
    reports = asyncio.run(_run(worker, [bad.SerializeToString()], 2))  # a session again
    assert [r.step_id for r in reports if "came after step 5" in r.error] == [3]


def test_a_stage_says_it_took_the_session_and_a_refused_one_is_never_whole(worker):
    """`Pipeline.open` returns only once every stage took the session (the Run's initial
    metadata): a second scheduler's open is refused, naming the cause, rather than returning
    at once and leaving its scheduler SERVING for the worker's whole wait."""

    async def main():
        first = Pipeline([worker])
        await first.open()  # taken: returns
        second = Pipeline([worker])
        try:
            with pytest.raises(PipelineUnavailable) as refused:
                await second.open()
            assert not second._calls, "a refused session's calls are closed"
        finally:
            await first.shutdown()
            await second.shutdown()
        return str(refused.value)

    message = asyncio.run(main())
    assert "refused the session: UNAVAILABLE" in message
    assert "serves another scheduler's session" in message


def test_a_scheduler_whose_stage_serves_another_is_never_serving(worker, redis_url):
    """The whole service: while another session holds its stage, the scheduler stays
    NOT_SERVING (it was SERVING ~5 s of every ~5.5 s retry, and routers sent it requests
    that got no token), saying why; once that session ends, it serves."""

    async def main():
        other = Pipeline([worker])
        await other.open()
        store = RedisStateStore(redis_url.rsplit("/", 1)[0] + "/9")
        service = SchedulerService(SchedulerConfig(), Pipeline([worker]), store)
        starting = asyncio.create_task(service.start())
        verdicts = set()
        deadline = time.monotonic() + 2.5 * SESSION_WAIT_S
        while time.monotonic() < deadline:
            verdicts.add(service.not_serving_reason is None)
            await asyncio.sleep(0.05)
        reason = service.not_serving_reason
        await other.shutdown()
        await asyncio.wait_for(starting, 4 * SESSION_WAIT_S)
        serving = service.serving
        await service.stop()
        return verdicts, reason, serving

    verdicts, reason, serving = asyncio.run(main())
    assert verdicts == {False}, "SERVING while another scheduler's session held the stage"
    assert "refused the session" in reason and "serves another scheduler's session" in reason
    assert serving

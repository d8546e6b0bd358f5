"""Sessions that end, or fail, while a stage is still joining the pipeline (the rendezvous).

Real worker processes on the simulated device, sessions opened as a scheduler opens them.
A stage takes a session (the Run's initial metadata) only once the stages formed the
pipeline, so a scheduler is never SERVING over stages that cannot meet; a stage stopped
while its session's thread sits in torch.distributed's rendezvous exits cleanly; and a
session that ended mid-join never holds up the next.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from services.common.errors import PipelineUnavailable
from services.common.pb import plan_to_pb
from services.common.redis_server import free_port
from services.scheduler import pipeline
from services.scheduler.pipeline import Pipeline
from services.worker.sim import MODELS_DIR
from tests.worker.test_joined_plans import _open_run, _plans, wait_ready

MODEL_DIR = MODELS_DIR / "llama-3-8b"
JOINING = "joining the pipeline"


@contextlib.contextmanager
def _workers(tmp_path: Path, dist_addrs: dict[int, str]):
    """Sim workers of a 2-stage pipeline, stage -> its --dist-addr; yields
    {stage: (address, process, log path)} once all are ready, and stops them after."""
    workers = {}
    try:
        for stage, dist_addr in dist_addrs.items():
            port, log = free_port(), tmp_path / f"stage{stage}.log"
            argv = ["worker", "--model", str(MODEL_DIR), "--device", "sim"]
            argv += ["--max-model-len", "512", "--stage", str(stage), "--stages", "2"]
            argv += ["--port", str(port), "--host", "127.0.0.1", "--dist-addr", dist_addr]
            cmd = [sys.executable, "-m", "services.cli", "--log-level", "INFO", *argv]
            with open(log, "w") as out:
                proc = subprocess.Popen(cmd, stderr=out, text=True)
            workers[stage] = (f"127.0.0.1:{port}", proc, log)
        for address, proc, _ in workers.values():
            wait_ready(address, proc)
        yield workers
    finally:
        for _, proc, _ in workers.values():
            if proc.poll() is None:
                proc.terminate()
        for _, proc, _ in workers.values():
            proc.wait(timeout=30)


async def _until_logged(log: Path, text: str, count: int = 1, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while log.read_text().count(text) < count:
        assert time.monotonic() < deadline, f"{text!r} not logged:\n{log.read_text()[-3000:]}"
        await asyncio.sleep(0.05)


def test_a_worker_stopped_while_joining_the_pipeline_exits_with_status_0(tmp_path):
    """Stage 1's session thread waits in the rendezvous for a stage 0 that never comes when
    SIGTERM does. The interpreter's exit would destroy torch's C++ objects under that
    thread, which could abort the process (exit -6, "terminate called without an active
    exception"): the worker leaves at once instead, with status 0."""

    async def join_and_stop(address: str, proc: subprocess.Popen, log: Path) -> None:
        async with grpc.aio.insecure_channel(address) as channel:
            _open_run(channel)
            await _until_logged(log, JOINING)
            await asyncio.sleep(0.3)
            proc.send_signal(signal.SIGTERM)
            await asyncio.to_thread(proc.wait, 60)

    with _workers(tmp_path, {1: f"127.0.0.1:{free_port()}"}) as workers:
        address, proc, log = workers[1]
        asyncio.run(join_and_stop(address, proc, log))
    stderr = log.read_text()
    assert proc.returncode == 0, stderr[-3000:]
    assert "exiting at once" in stderr, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]


def test_a_session_ended_mid_join_does_not_hold_up_the_next(tmp_path):
    """A session that ends while stage 0 waits in the rendezvous for a stage 1 that never
    came (it died mid-join) is not waited for, and its wait does not block stage 0's store
    connection: the next session, under other keys, forms at once (before: only after the
    old thread's 60 s rendezvous timeout, the new session refused for 5 s first)."""
    plan = plan_to_pb(_plans([0, 0])[0], False).SerializeToString()

    async def end_mid_join_then_form(stage0: str, stage1: str, log0: Path):
        async with (
            grpc.aio.insecure_channel(stage0) as channel0,
            grpc.aio.insecure_channel(stage1) as channel1,
        ):
            lost = _open_run(channel0)  # stage 1 never joins this one
            await _until_logged(log0, JOINING)
            await asyncio.sleep(0.3)
            lost.cancel()
            epoch = str(time.time_ns())  # the next session's, the same for both stages
            calls = [_open_run(channel, epoch) for channel in (channel0, channel1)]
            for call in calls:
                await call.write(plan)
            report = await asyncio.wait_for(calls[1].read(), 60)
            for call in calls:
                call.cancel()
            return report

    dist_addr = f"127.0.0.1:{free_port()}"
    with _workers(tmp_path, {0: dist_addr, 1: dist_addr}) as workers:
        (stage0, _, log0), (stage1, _, _) = workers[0], workers[1]
        report = asyncio.run(end_mid_join_then_form(stage0, stage1, log0))
    log = log0.read_text()
    assert (report.step_id, report.error, len(report.token_ids)) == (0, "", 1), log[-3000:]
    assert "leaving an ended session's rendezvous to its thread" in log, log[-3000:]
    assert "abandoning a session stuck" not in log, log[-3000:]


def test_a_stage_that_cannot_join_refuses_the_session_saying_why(tmp_path):
    """Stage 0 cannot serve the rendezvous (its --dist-addr port is taken): its Run ends
    UNAVAILABLE with the reason, never taken (before: taken at once, its scheduler SERVING,
    every plan then failing)."""

    async def open_session(address: str) -> grpc.aio.AioRpcError:
        async with grpc.aio.insecure_channel(address) as channel:
            call = _open_run(channel)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await asyncio.wait_for(call.read(), 60)
            assert not dict(await call.initial_metadata() or ()), "the session was taken"
            return refused.value

    with socket.create_server(("127.0.0.1", 0)) as taken:
        dist_addr = f"127.0.0.1:{taken.getsockname()[1]}"
        with _workers(tmp_path, {0: dist_addr}) as workers:
            refused = asyncio.run(open_session(workers[0][0]))
    assert refused.code() is grpc.StatusCode.UNAVAILABLE
    assert "stage 0 could not join the pipeline" in refused.details(), refused.details()
    assert "in use" in refused.details(), refused.details()


def test_a_scheduler_does_not_form_a_pipeline_whose_stages_cannot_meet(tmp_path, monkeypatch):
    """Stage 1 looks for the rendezvous where nothing serves it: neither stage can join, so
    the scheduler's session does not open (the scheduler stays NOT_SERVING) and the error
    names both stages (before: opened at once, SERVING over a pipeline that could not run)."""
    monkeypatch.setattr(pipeline, "SESSION_ACCEPT_TIMEOUT_S", 3.0)
    dist_addrs = {0: f"127.0.0.1:{free_port()}", 1: f"127.0.0.1:{free_port()}"}

    async def open_session(addresses: list[str]) -> PipelineUnavailable:
        stages = Pipeline(addresses)
        with pytest.raises(PipelineUnavailable) as refused:
            await stages.open()
        assert not stages._calls, "a session that did not open leaves no call behind"
        return refused.value

    with _workers(tmp_path, dist_addrs) as workers:
        error = asyncio.run(open_session([workers[0][0], workers[1][0]]))
    assert "did not join the pipeline within 3 s" in str(error), error
    assert all(f"stage {stage} ({workers[stage][0]})" in str(error) for stage in (0, 1)), error

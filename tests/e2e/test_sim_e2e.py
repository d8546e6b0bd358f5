"""`conveyor up --device sim` end to end: real processes, gloo between the stages, the router.

Llama-3-8B on 3 modeled H100 stages: every stream gets exactly the tokens the sim derives
from its seed, or from its prompt when greedy (the scheduler gives an unseeded random
request a random seed), and the scheduler's KV pool is what the stages computed from the
profile's memory (no memory is allocated for it).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from services.client import AsyncConveyorClient
from services.common.proto.conveyor.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from services.common.sampling import SamplingParams
from services.worker.model.config import ModelConfig
from services.worker.model.stages import logits_layer_equivalents, split_layers
from services.worker.sim import MODELS_DIR
from services.worker.sim.profiles import load_profile
from services.worker.sim.timing import StageTimingModel
from services.worker.sim.tokens import TokenSource
from tests.conftest import free_port
from tests.processes import logged_process

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
MODEL_DIR = MODELS_DIR / "llama-3-8b"
NUM_STAGES = 3
PROMPTS = [f"Request {i}: the pipeline has {i + 2} stages." for i in range(12)]


@pytest.fixture(scope="module")
def sim_stack(tmp_path_factory):
    """(router address, scheduler address) of `conveyor up --device sim`."""
    from services.launcher import wait_serving

    port, scheduler_port = free_port(), free_port()
    log = (tmp_path_factory.mktemp("sim") / "conveyor-up.log").open("w")
    argv = [
        *(sys.executable, "-m", "services.cli", "up", "--no-http", "--model", str(MODEL_DIR)),
        *("--stages", str(NUM_STAGES), "--device", "sim", "--sim-profile", "h100"),
        *("--port", str(port), "--scheduler-port", str(scheduler_port)),
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    with logged_process(proc, log):
        wait_serving(f"127.0.0.1:{port}", 300, proc)
        yield f"127.0.0.1:{port}", f"127.0.0.1:{scheduler_port}"


def test_sim_stack_streams_each_request_its_sim_tokens(sim_stack):
    router, _ = sim_stack
    config = ModelConfig.from_dir(MODEL_DIR)
    source = TokenSource.from_model_dir(MODEL_DIR, config.vocab_size, config.eos_token_ids)

    async def main():
        async with AsyncConveyorClient(router, timeout_s=120) as client:
            seeds = [None if i % 2 else 100 + i for i in range(len(PROMPTS))]
            results = await asyncio.gather(
                *(
                    client.complete(
                        p,
                        max_tokens=24,
                        ignore_eos=True,
                        temperature=0.0 if s is None else 1.0,
                        seed=s,
                    )
                    for p, s in zip(PROMPTS, seeds, strict=True)
                )
            )
            prompt_ids = [await client.tokenize(p) for p in PROMPTS]  # the async client
            return results, prompt_ids, seeds

    results, prompt_ids, seeds = asyncio.run(main())
    for result, ids, seed in zip(results, prompt_ids, seeds, strict=True):
        sampling = SamplingParams(max_tokens=24, ignore_eos=True, seed=seed)
        assert result.finish_reason == "length"
        assert result.token_ids == source.expected_tokens(ids, sampling, 24)


def _tokenize(router: str, text: str) -> list[int]:
    from services.client import ConveyorClient

    with ConveyorClient(router, timeout_s=60) as client:
        return client.tokenize(text)


def test_sim_stack_kv_pool_comes_from_the_profile(sim_stack):
    _, scheduler = sim_stack
    with grpc.insecure_channel(scheduler) as channel:
        stats = scheduler_pb2_grpc.SchedulerStub(channel).GetStats(
            scheduler_pb2.GetStatsRequest(), timeout=30
        )
    config, h100 = ModelConfig.from_dir(MODEL_DIR), load_profile("h100")
    extra = logits_layer_equivalents(config.vocab_size, config.hidden_size, config.num_layer_params)
    counts = split_layers(config.num_hidden_layers, NUM_STAGES, last_stage_extra=extra)
    blocks = [
        StageTimingModel(config, h100, n, i == 0, i == NUM_STAGES - 1).num_kv_blocks(16, None, 8192)
        for i, n in enumerate(counts)
    ]
    assert stats.num_stages == NUM_STAGES and stats.serving
    assert stats.num_blocks == min(blocks)
    assert stats.num_free_blocks == stats.num_blocks  # every stream above was freed


# -- Scheduler.Session: the router's one stream, spoken here directly ------------------------
class _Session:
    """A Session call fed from a queue; `updates()` reads until the given streams end."""

    def __init__(self, channel: grpc.aio.Channel):
        self._commands: asyncio.Queue = asyncio.Queue()
        self.call = scheduler_pb2_grpc.SchedulerStub(channel).Session(self._send(), timeout=120)
        self.responses: list[scheduler_pb2.SessionResponse] = []

    async def _send(self):
        while (command := await self._commands.get()) is not None:
            yield command

    def send(self, stream_id: int = 0, **command) -> None:
        self._commands.put_nowait(scheduler_pb2.SessionRequest(stream_id=stream_id, **command))

    async def until_ended(self, stream_ids) -> dict[int, list[scheduler_pb2.SessionUpdate]]:
        """Every update of `stream_ids` until each one's last (a finish, an end, a status)."""
        updates: dict[int, list] = {i: [] for i in stream_ids}
        open_ids = set(stream_ids)
        while open_ids:
            response = await self.call.read()
            assert response is not grpc.aio.EOF, f"session ended with {open_ids} open"
            self.responses.append(response)
            for update in response.updates:
                if update.stream_id in open_ids:
                    updates[update.stream_id].append(update)
                    if update.status_code or update.ended or update.delta.finish_reason:
                        open_ids.discard(update.stream_id)
        return updates

    async def next_delta(self, stream_id: int) -> scheduler_pb2.TokenDelta:
        """The next delta of a stream (the others' updates before it are dropped)."""
        while True:
            response = await self.call.read()
            for update in response.updates:
                if update.stream_id == stream_id and update.HasField("delta"):
                    return update.delta


def _submit(request_id: str, prompt: list[int], max_tokens: int, **fields):
    sampling = common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True, seed=7)
    return scheduler_pb2.SubmitRequest(
        request_id=request_id, prompt_token_ids=prompt, sampling=sampling, **fields
    )


def _tokens(updates) -> list[int]:
    return [t for u in updates if u.HasField("delta") for t in u.delta.token_ids]


def test_session_streams_many_requests_per_message_with_their_submit_tokens(sim_stack):
    """One session, 12 requests: each gets exactly what its own Submit stream gets, and the
    scheduler sent the deltas of several requests in one message."""
    _, scheduler = sim_stack
    prompts = [[10 + i, 20 + i, 30 + i] for i in range(12)]

    async def main():
        async with grpc.aio.insecure_channel(scheduler) as channel:
            session = _Session(channel)
            for i, prompt in enumerate(prompts):
                session.send(i + 1, submit=_submit(f"s{i}", prompt, 16, principal="alice"))
            updates = await session.until_ended(range(1, 13))
            stub = scheduler_pb2_grpc.SchedulerStub(channel)
            alone = []
            for i, prompt in enumerate(prompts):
                deltas = [d async for d in stub.Submit(_submit(f"alone{i}", prompt, 16))]
                alone.append([t for d in deltas for t in d.token_ids])
            session.call.cancel()
            return updates, session.responses, alone

    updates, responses, alone = asyncio.run(main())
    for i in range(12):
        stream = updates[i + 1]
        assert _tokens(stream) == alone[i] and len(alone[i]) == 16
        assert stream[0].delta.num_prompt_tokens == 3
        assert stream[-1].delta.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert max(len(r.updates) for r in responses) > 1


def test_session_checks_owners_refuses_bad_commands_and_aborts(sim_stack):
    _, scheduler = sim_stack
    owner = {"principal": "bob", "owner_token": "right"}
    wrong = {"principal": "bob", "owner_token": "wrong"}

    async def main():
        async with grpc.aio.insecure_channel(scheduler) as channel:
            session = _Session(channel)
            session.send(1, submit=_submit("long", [1, 2, 3], 4000, **owner))
            session.send(2, submit=_submit("bad", [], 4))  # no prompt: INVALID_ARGUMENT
            session.send(3, submit=_submit("long", [1, 2], 4, **owner))  # running: exists
            bad = await session.until_ended([2, 3])
            await session.next_delta(1)  # running
            session.send(abort=scheduler_pb2.AbortRequest(request_id="long", **wrong))
            resume_as = scheduler_pb2.ResumeRequest(request_id="long", from_offset=0, **wrong)
            session.send(4, resume=resume_as)
            refused = await session.until_ended([4])
            still = await session.next_delta(1)  # commands act in order: after the abort
            session.send(5, resume=scheduler_pb2.ResumeRequest(request_id="long", **owner))
            session.send(abort=scheduler_pb2.AbortRequest(request_id="long", **owner))
            ended = await session.until_ended([1, 5])
            session.send(5, cancel=True)  # already ended: nothing happens
            session.send(6, submit=_submit("again", [4, 5], 3))
            again = await session.until_ended([6])
            session.send(6, submit=_submit("twice", [4, 5], 3))
            session.send(6, submit=_submit("twice-more", [4, 5], 3))
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await session.until_ended([])
                while await session.call.read() is not grpc.aio.EOF:
                    pass
            return bad, refused, still, ended, again, error.value

    bad, refused, still, ended, again, error = asyncio.run(main())
    assert bad[2][-1].status_code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "prompt" in bad[2][-1].status_message
    assert bad[3][-1].status_code == grpc.StatusCode.ALREADY_EXISTS.value[0]
    assert refused[4][-1].status_code == grpc.StatusCode.NOT_FOUND.value[0]
    abort = common_pb2.FINISH_REASON_ABORT
    assert ended[1][-1].delta.finish_reason == abort == ended[5][-1].delta.finish_reason
    assert still.token_ids and not still.finish_reason  # the wrong owner's abort did nothing
    last = ended[1][-1].delta
    assert len(_tokens(ended[5])) == last.offset + len(last.token_ids)  # resumed from 0
    assert len(_tokens(again[6])) == 3
    assert error.code() is grpc.StatusCode.INVALID_ARGUMENT and "stream_id 6" in error.details()


def test_async_window_grows_while_stage_0_waits_for_plans(tmp_path):
    """Two simulated stages that take no time, over real gRPC and gloo: stage 0 ends each
    step before the scheduler's next plan reaches it, reports the waits on its Run stream,
    and the scheduler plans further ahead (at most 2P in flight); `GetStats` and `conveyor
    stats` say so, and every request still gets exactly its tokens."""
    from services.common.stats_cli import format_table, stats_to_dict
    from services.launcher import wait_serving
    from tests.pipeline.test_sim import instant_profile

    port, scheduler_port = free_port(), free_port()
    log = (tmp_path / "conveyor-up.log").open("w")
    argv = [
        *(sys.executable, "-m", "services.cli", "up", "--no-http", "--model", str(MODEL_DIR)),
        *("--stages", "2", "--device", "sim", "--sim-profile", instant_profile(tmp_path)),
        *("--port", str(port), "--scheduler-port", str(scheduler_port)),
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    router = f"127.0.0.1:{port}"
    config = ModelConfig.from_dir(MODEL_DIR)
    source = TokenSource.from_model_dir(MODEL_DIR, config.vocab_size, config.eos_token_ids)

    async def main():
        async with AsyncConveyorClient(router, timeout_s=120) as client:
            return await asyncio.gather(
                *(
                    client.complete(p, max_tokens=160, ignore_eos=True, seed=7 + i)
                    for i, p in enumerate(PROMPTS[:8])
                )
            )

    with logged_process(proc, log):
        wait_serving(router, 300, proc)
        results = asyncio.run(main())
        with grpc.insecure_channel(f"127.0.0.1:{scheduler_port}") as channel:
            stats = scheduler_pb2_grpc.SchedulerStub(channel).GetStats(
                scheduler_pb2.GetStatsRequest(), timeout=30
            )
        for i, (prompt, result) in enumerate(zip(PROMPTS, results, strict=False)):
            sampling = SamplingParams(max_tokens=160, ignore_eos=True, seed=7 + i)
            expected = source.expected_tokens(_tokenize(router, prompt), sampling, 160)
            assert result.token_ids == expected
        assert stats.scheduling == "async"
        assert stats.async_lead_changes >= 1
        assert 1 < stats.async_lead <= 2
        assert stats.max_inflight == 2 + stats.async_lead
        assert stats.plan_wait_fraction[0] > 0
        table = format_table(stats_to_dict(stats, top=0))
        assert f"{stats.max_inflight} steps in flight at most (P + {stats.async_lead}" in table

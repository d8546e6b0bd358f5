"""`conveyor up --device sim` end to end: real processes, gloo between the stages, the router.

Llama-3-8B on 3 modeled H100 stages: every stream gets exactly the tokens the sim derives
from its seed, or from its prompt when greedy (the scheduler gives an unseeded random
request a random seed), and the scheduler's KV pool is what the stages computed from the
profile's memory (no memory is allocated for it).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from services.client import AsyncConveyorClient
from services.common.proto.conveyor.v1 import scheduler_pb2, scheduler_pb2_grpc
from services.common.sampling import SamplingParams
from services.worker.model.config import ModelConfig
from services.worker.model.stages import logits_layer_equivalents, split_layers
from services.worker.sim import MODELS_DIR
from services.worker.sim.profiles import load_profile
from services.worker.sim.timing import StageTimingModel
from services.worker.sim.tokens import TokenSource
from tests.conftest import free_port

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
    try:
        wait_serving(f"127.0.0.1:{port}", 300, proc)
        yield f"127.0.0.1:{port}", f"127.0.0.1:{scheduler_port}"
    except BaseException:
        log.flush()
        print(Path(log.name).read_text()[-5000:], file=sys.stderr)
        raise
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


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
            prompt_ids = [await asyncio.to_thread(_tokenize, router, p) for p in PROMPTS]
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

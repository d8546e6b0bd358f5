"""A short simulated experiment: the real scheduler over 4 simulated stages (Llama-3-70B on
modeled H200s), in one process.

What does not depend on the machine's speed: every request gets exactly the tokens the sim
derives from its seed or prompt, the same in sync and async mode, and async keeps more
micro-batches in flight than sync. The figures (bubble, throughput ratios) come from the
benchmark, not from here.
"""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path

import pytest

from services.common.sampling import SamplingParams
from services.worker.config import WorkerConfig
from services.worker.sim import MODELS_DIR
from services.worker.sim.profiles import load_profile
from services.worker.sim.runner import SimStageRunner
from services.worker.sim.transport import SimTransport
from tests.pipeline.utils import InProcessStack

MODEL_DIR = MODELS_DIR / "llama-3-70b"
NUM_STAGES = 4
NUM_REQUESTS = 24
MAX_MODEL_LEN = 1024


def sim_runners(num_stages: int = NUM_STAGES, profile: str = "h200") -> list[SimStageRunner]:
    return [
        SimStageRunner.from_config(
            WorkerConfig(
                model_dir=str(MODEL_DIR),
                stage_index=stage,
                num_stages=num_stages,
                device="sim",
                sim_profile=profile,
                max_model_len=MAX_MODEL_LEN,
            )
        )
        for stage in range(num_stages)
    ]


def workload() -> tuple[list[list[int]], list[SamplingParams]]:
    """Prompts of 8-120 ids of the shipped tokenizer; half seeded, half keyed by prompt."""
    rng = random.Random(16)
    prompts = [[rng.randrange(3, 400) for _ in range(rng.randint(8, 120))] for _ in range(24)]
    sampling = [
        SamplingParams(
            max_tokens=rng.randint(8, 24),
            ignore_eos=True,
            temperature=1.0 if i % 2 else 0.0,
            seed=1000 + i if i % 2 else None,
        )
        for i in range(NUM_REQUESTS)
    ]
    return prompts, sampling


async def run(scheduling: str, redis_url: str) -> tuple[list, list[int], InProcessStack]:
    """(outcomes, the scheduler's in-flight count sampled every ms, the stack)."""
    prompts, sampling = workload()
    runners = sim_runners()
    async with InProcessStack(
        MODEL_DIR,
        NUM_STAGES,
        scheduling,
        redis_url,
        max_model_len=MAX_MODEL_LEN,
        runners=runners,
        wrap_transport=lambda transport, runner: SimTransport(transport, runner.timing_model),
    ) as stack:
        samples: list[int] = []
        done = asyncio.Event()

        async def sample_inflight() -> None:
            while not done.is_set():
                samples.append(stack.service.inflight)
                await asyncio.sleep(0.001)

        sampler = asyncio.create_task(sample_inflight())
        outcomes = await stack.generate(prompts, sampling)
        done.set()
        await sampler
    return outcomes, samples, stack


@pytest.fixture(scope="module")
def runs(redis_url):
    return {mode: asyncio.run(run(mode, redis_url)) for mode in ("sync", "async")}


@pytest.mark.parametrize("scheduling", ["sync", "async"])
def test_sim_pipeline_gives_every_request_exactly_its_tokens(scheduling, runs):
    outcomes, _, stack = runs[scheduling]
    prompts, sampling = workload()
    tokens = stack.runners[-1].tokens
    for outcome, prompt, params in zip(outcomes, prompts, sampling, strict=True):
        assert outcome.finish_reason == "length"
        assert outcome.token_ids == tokens.expected_tokens(prompt, params, params.max_tokens)
    assert all(0 <= t < 400 for o in outcomes for t in o.token_ids)
    assert stack.pipeline.errors == []
    assert stack.num_free_blocks == stack.num_blocks


def test_sim_pipeline_sync_and_async_agree(runs):
    sync, async_ = runs["sync"][0], runs["async"][0]
    assert [o.token_ids for o in sync] == [o.token_ids for o in async_]


def test_sim_pipeline_async_keeps_more_micro_batches_in_flight(runs):
    """Sync plans a request again only once its token came back (at most P steps in
    flight); async plans at least one step ahead (P + a lead of 1 to P) and stage 0 takes
    tokens from the last stage."""
    _, sync_inflight, _ = runs["sync"]
    _, async_inflight, async_stack = runs["async"]
    assert max(sync_inflight) <= NUM_STAGES
    assert NUM_STAGES + 1 <= max(async_inflight) <= 2 * NUM_STAGES
    assert sum(async_inflight) / len(async_inflight) > sum(sync_inflight) / len(sync_inflight)
    assert async_stack.hub.tokens_sent, "the last stage forwarded no token to stage 0"


def instant_profile(directory: Path) -> str:
    """The h200 profile with every cost divided by a million: stages that take no time."""
    fields = load_profile("h200").to_dict()
    for key in ("peak_flops", "memory_bandwidth", "link_bandwidth", "tp_bandwidth"):
        fields[key] *= 1e6
    for key in ("step_overhead_s", "layer_overhead_s", "seq_overhead_s", "link_latency_s"):
        fields[key] = 0.0
    fields["name"] = "instant"
    path = directory / "instant.json"
    path.write_text(json.dumps(fields))
    return str(path)


def test_stage_0_reports_its_plan_waits_and_the_lead_costs_no_token(redis_url, tmp_path):
    """Stages that take no time: stage 0 ends each step before the scheduler's next plan
    can reach it and reports those waits. Whether the lead grows on them depends on this
    machine's thread timing (the scheduler must have sat idle with a full window; it did
    not in 2 of 4 CI runs): the rule is tests/scheduler/test_lead.py's. Here the lead stays
    within P, the window follows it, and a window changing under the steps in flight costs
    no request a token."""
    num_stages = 2
    rng = random.Random(22)
    prompts = [[rng.randrange(3, 400) for _ in range(rng.randint(8, 40))] for _ in range(8)]
    sampling = [SamplingParams(max_tokens=160, ignore_eos=True, seed=50 + i) for i in range(8)]
    runners = sim_runners(num_stages, instant_profile(tmp_path))

    async def main():
        async with InProcessStack(
            MODEL_DIR,
            num_stages,
            "async",
            redis_url,
            max_model_len=MAX_MODEL_LEN,
            runners=runners,
            wrap_transport=lambda transport, runner: SimTransport(transport, runner.timing_model),
        ) as stack:
            outcomes = await stack.generate(prompts, sampling)
            return outcomes, stack

    outcomes, stack = asyncio.run(main())
    tokens = runners[-1].tokens
    for outcome, prompt, params in zip(outcomes, prompts, sampling, strict=True):
        assert outcome.token_ids == tokens.expected_tokens(prompt, params, params.max_tokens)
    assert stack.pipeline.errors == []
    assert stack.pipeline.plan_waits, "stage 0 reported no plan wait"
    lead = stack.service.lead
    assert 1 <= lead.lead <= num_stages
    assert num_stages < stack.service.max_inflight <= num_stages + lead.max_lead
    assert stack.num_free_blocks == stack.num_blocks

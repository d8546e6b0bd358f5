"""`SimStageRunner`: the real plan bookkeeping of a stage, a modeled step, the wire check."""

from __future__ import annotations

import pytest

from services.common.sampling import SamplingParams
from services.common.step import CachedRequest, NewRequest, StepPlan, StepResult
from services.worker.config import WorkerConfig
from services.worker.sim import MODELS_DIR
from services.worker.sim.runner import COL_STEP, SimStageRunner

MODEL_DIR = MODELS_DIR / "llama-3-8b"


def runners(num_stages: int = 2, **kwargs) -> list[SimStageRunner]:
    return [
        SimStageRunner.from_config(
            WorkerConfig(
                model_dir=str(MODEL_DIR),
                stage_index=stage,
                num_stages=num_stages,
                device="sim",
                max_model_len=512,
                **{"sim_profile": "h100", **kwargs},
            )
        )
        for stage in range(num_stages)
    ]


def prefill_plan() -> StepPlan:
    new = [
        NewRequest("a", [10, 11, 12], 3, SamplingParams(ignore_eos=True), [0], 0, 3),
        NewRequest("b", [20, 21], 2, SamplingParams(seed=5, logprobs=2), [1], 0, 2),
    ]
    return StepPlan(0, new_requests=new)


def run_chain(stages: list[SimStageRunner], plan: StepPlan) -> StepResult:
    wire = None
    for runner in stages:
        wire = runner.execute(plan, hidden_in=wire)
    return wire


def test_sim_stages_sample_the_sim_tokens_and_keep_request_state():
    stages = runners()
    first = run_chain(stages, prefill_plan())
    tokens = stages[-1].tokens
    assert first.request_ids == ["a", "b"]
    expected_a = tokens.expected_tokens([10, 11, 12], SamplingParams(ignore_eos=True), 2)
    expected_b = tokens.expected_tokens([20, 21], SamplingParams(seed=5), 2)
    assert first.token_ids == [expected_a[0], expected_b[0]]
    assert first.logprobs[0] is None and first.logprobs[1].top_token_ids[0] == expected_b[0]
    decode = StepPlan(
        1,
        cached_requests=[
            CachedRequest("a", 1, [], [first.token_ids[0]]),
            CachedRequest("b", 1, [], [first.token_ids[1]]),
        ],
    )
    second = run_chain(stages, decode)
    assert second.token_ids == [expected_a[1], expected_b[1]]
    for runner in stages:  # the real bookkeeping: computed tokens and block tables
        assert runner.requests["a"].num_computed_tokens == 4
        assert runner.block_tables.block_ids(runner.requests["b"].row) == [1]
        assert runner.modeled_s > 0 and runner.last_cost.total_s > 0
    assert stages[0].last_cost.logits_s == 0 < stages[1].last_cost.logits_s


def test_sim_stage_refuses_activations_of_another_step():
    stages = runners()
    wire = stages[0].execute(prefill_plan())
    wire[:, COL_STEP] = 9
    with pytest.raises(ValueError, match="step"):
        stages[1].execute(prefill_plan(), hidden_in=wire)


def test_sim_stage_refuses_activations_of_other_positions():
    stages = runners()
    wire = stages[0].execute(prefill_plan())
    with pytest.raises(ValueError, match="positions or KV slots"):
        stages[1].execute(prefill_plan(), hidden_in=wire.flip(0))


def test_sim_stage_reports_the_modeled_device_and_kv_capacity():
    stages = runners(num_stages=4)
    assert {r.device_kind for r in stages} == {"cuda"}
    assert [r.model.stage.num_layers for r in stages] == [8, 9, 8, 7]  # the real split
    assert all(r.kv_cache.num_blocks > 10_000 for r in stages)
    cpu = runners(num_stages=1, sim_profile="cpu", kv_cache_memory="256MiB")[0]
    assert cpu.device_kind == "cpu"
    assert cpu.kv_cache.num_blocks == (256 << 20) // (16 * 32 * 2 * 8 * 128 * 4)

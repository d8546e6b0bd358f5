"""Staging new weights beside a live stage and swapping them in (tiny random models)."""

from __future__ import annotations

import pytest
from safetensors.torch import load_file

from services.common.errors import InvalidRequest, ModelLoadError
from services.worker.model.loader import SafetensorsReader
from services.worker.weights import (
    TensorReader,
    commit,
    owns,
    select_layers,
    select_received,
    stage_weights,
)
from tests.worker.utils import (
    TinyPlanner,
    compare_greedy,
    hf_greedy,
    make_prompts,
    make_runners,
    make_tiny_model,
    run_plans,
)


def _greedy(runners, prompts, max_new=6):
    planner = TinyPlanner(block_size=16, num_blocks=128)
    for i, prompt in enumerate(prompts):
        planner.add(f"r{i}", prompt, max_new)
    outputs = run_plans(planner, runners)
    return [outputs[f"r{i}"] for i in range(len(prompts))]


def _assert_serves(runners, model_dir, prompts):
    ref_tokens, ref_logits = hf_greedy(model_dir, prompts, 6)
    for ours, ref, logits in zip(_greedy(runners, prompts), ref_tokens, ref_logits, strict=True):
        compare_greedy(ours, ref, logits, 1e-4)


@pytest.mark.parametrize(
    "tied, onednn, num_stages", [(False, False, 2), (True, True, 2), (True, False, 1)]
)
def test_stage_weights_from_files_then_commit_serves_the_new_model(
    tmp_path, tied, onednn, num_stages
):
    old = make_tiny_model(tmp_path / "old", tied=tied, seed=0)
    new = make_tiny_model(tmp_path / "new", tied=tied, seed=1)
    runners = make_runners(old, num_stages, onednn=onednn)
    prompts = make_prompts(3, seed=3)
    for runner in runners:
        model = runner.model
        staged = stage_weights(model, SafetensorsReader(new), select_layers(model, []), 1)
        commit(model, staged)
    _assert_serves(runners, new, prompts)


def test_stage_weights_from_received_tensors_keeps_what_each_stage_owns(tmp_path):
    old = make_tiny_model(tmp_path / "old", tied=True, seed=0)
    new = make_tiny_model(tmp_path / "new", tied=True, seed=1)
    runners = make_runners(old, 2, onednn=True)
    sent = load_file(str(new / "model.safetensors"))  # what a trainer broadcasts
    for runner in runners:
        model = runner.model
        kept = {name: t for name, t in sent.items() if owns(model, name)}
        staged = stage_weights(model, TensorReader(kept), select_received(model, set(kept)), 1)
        commit(model, staged)
    _assert_serves(runners, new, make_prompts(3, seed=4))


def test_stage_weights_refuses_bad_layers_and_incomplete_layers(tmp_path):
    old = make_tiny_model(tmp_path / "old", seed=0)
    (runner,) = make_runners(old, 1)
    model = runner.model
    with pytest.raises(InvalidRequest, match="do not exist"):
        select_layers(model, [3])
    sent = {
        "model.layers.1.self_attn.q_proj.weight": load_file(str(old / "model.safetensors"))[
            "model.layers.1.self_attn.q_proj.weight"
        ]
    }
    with pytest.raises(ModelLoadError, match="part of a layer"):
        stage_weights(model, TensorReader(sent), select_received(model, set(sent)), 1)

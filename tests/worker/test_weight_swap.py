"""Staging new weights beside a live stage and swapping them in (tiny random models)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from services.common.errors import InvalidRequest, ModelLoadError
from services.worker.model.loader import SafetensorsReader, load_stage_model
from services.worker.model.quant import load_quantized_stage
from services.worker.model.stages import stage_spec
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


@pytest.mark.parametrize("method", ["int8", "fp8"])
def test_weight_update_of_a_quantized_stage_stays_quantized(tmp_path, method):
    from services.worker.model.quant import QuantLinear
    from tests.worker.test_quant import _relative_error

    old = make_tiny_model(tmp_path / "old", seed=0)
    new = make_tiny_model(tmp_path / "new", seed=1)
    runners = make_runners(old, 2, quantization=method)
    for runner in runners:
        model = runner.model
        commit(model, stage_weights(model, SafetensorsReader(new), select_layers(model, []), 1))
        assert isinstance(model.layers[0].mlp.gate_up_proj, QuantLinear)
        # fp8 keeps down_proj in the compute dtype (quantization_ignore), updates too.
        kept = isinstance(model.layers[0].mlp.down_proj, torch.nn.Linear)
        assert kept == (method == "fp8") and model.quantization.method == method
    fresh = make_runners(new, 2, quantization=method)
    prompts = make_prompts(3, seed=3)
    assert _greedy(runners, prompts) == _greedy(fresh, prompts)  # as if loaded quantized
    assert (
        _relative_error(
            runners[0].model.layers[0].mlp.gate_up_proj.scale,
            fresh[0].model.layers[0].mlp.gate_up_proj.scale,
        )
        == 0
    )


def test_weight_update_packs_the_projections_fp8_keeps(tmp_path):
    """On oneDNN, fp8's kept down_proj is packed at load; an update packs it again."""
    from services.worker.model.packed_linear import PackedLinear
    from services.worker.model.quant import QuantLinear

    old = make_tiny_model(tmp_path / "old", seed=0)
    new = make_tiny_model(tmp_path / "new", seed=1)
    (runner,) = make_runners(old, 1, quantization="fp8", onednn=True)
    model = runner.model
    assert isinstance(model.layers[0].mlp.down_proj, PackedLinear)
    commit(model, stage_weights(model, SafetensorsReader(new), select_layers(model, []), 1))
    assert isinstance(model.layers[0].mlp.down_proj, PackedLinear)
    assert isinstance(model.layers[0].mlp.gate_up_proj, QuantLinear)
    (fresh,) = make_runners(new, 1, quantization="fp8", onednn=True)
    prompts = make_prompts(3, seed=3)
    assert _greedy([runner], prompts) == _greedy([fresh], prompts)


def _tensors(model) -> dict[str, torch.Tensor]:
    named = [*model.named_parameters(), *model.named_buffers()]
    return {name: t for name, t in named if t is not None and name != "rotary.cos_cache"}


def _assert_same_tensors(ours, fresh) -> None:
    a, b = _tensors(ours), _tensors(fresh)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


@pytest.mark.parametrize("tied", [False, True])
def test_stage_weights_on_tensor_parallel_ranks_take_their_shard(tmp_path, tied):
    """Each rank of a 2-rank stage, given every tensor (a trainer's broadcast), holds exactly
    what a rank loaded from the new checkpoint holds."""
    old = make_tiny_model(tmp_path / "old", tied=tied, seed=0)
    new = make_tiny_model(tmp_path / "new", tied=tied, seed=1)
    sent = load_file(str(new / "model.safetensors"))
    stage = stage_spec(3, 1, 0)
    for rank in range(2):
        model = load_stage_model(old, stage, tp_rank=rank, tensor_parallel_size=2)
        kept = {name: t for name, t in sent.items() if owns(model, name)}
        commit(
            model, stage_weights(model, TensorReader(kept), select_received(model, set(kept)), 1)
        )
        fresh = load_stage_model(new, stage, tp_rank=rank, tensor_parallel_size=2)
        _assert_same_tensors(model, fresh)


def test_stage_weights_on_a_quantized_stage_quantizes_the_new_layers(tmp_path):
    old = make_tiny_model(tmp_path / "old", seed=0)
    new = make_tiny_model(tmp_path / "new", seed=1)
    stage = stage_spec(3, 1, 0)
    model = load_quantized_stage(old, stage, "float32", "int8")
    commit(model, stage_weights(model, SafetensorsReader(new), select_layers(model, []), 1))
    _assert_same_tensors(model, load_quantized_stage(new, stage, "float32", "int8"))

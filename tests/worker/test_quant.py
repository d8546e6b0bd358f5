"""Weight-only quantization: round trips, the CPU matmuls against the dequantized reference,
FP8 checkpoints, and a quantized model split into stages equal to the same model unsplit."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from services.common.errors import ConfigError, ModelLoadError
from services.worker.config import WorkerConfig, parse_projections
from services.worker.model.quant import (
    FP8_MAX,
    QuantLinear,
    checkpoint_quantization,
    dequantize,
    load_quantized_stage,
    quantize_fp8,
    quantize_int8,
    quantize_linears,
)
from services.worker.model.stages import stage_spec
from tests.worker.utils import (
    TinyPlanner,
    make_fp8_checkpoint,
    make_prompts,
    make_runners,
    make_tiny_model,
    run_plans,
)

MAX_LOGIT_ERROR = {"int8": 0.05, "fp8": 0.2}
"""|quantized - unquantized| / |unquantized| of a random tiny model's first logits."""


def _weight(rows: int = 96, cols: int = 80, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(rows, cols, generator=gen)
    weight[3] *= 100.0  # rows of very different ranges: each gets its own scale
    weight[5] = 0.0  # an all-zero row must not divide by zero
    return weight


def test_int8_round_trip_error_is_at_most_half_a_step():
    weight = _weight()
    q, scale = quantize_int8(weight)
    assert q.dtype == torch.int8 and scale.shape == (96,)
    assert int(q.abs().max()) <= 127
    error = (dequantize(q, scale, torch.float32) - weight).abs()
    assert bool((error <= scale[:, None] / 2 + 1e-6).all())
    assert scale.to(torch.bfloat16).float().equal(scale)  # exact as the CPU kernel's bf16


def test_fp8_round_trip_keeps_e4m3_precision():
    weight = _weight()
    q, scale = quantize_fp8(weight)
    assert q.dtype == torch.float8_e4m3fn
    assert float(q.float().abs().max()) == FP8_MAX
    back = dequantize(q, scale, torch.float32)
    # e4m3 keeps 3 mantissa bits: relative error <= 2^-4 above the subnormal range.
    normal = weight.abs() >= 2**-6 * scale[:, None]
    assert bool(((back - weight).abs() <= weight.abs() * 2**-4 + 1e-6)[normal].all())
    assert bool(torch.isfinite(back).all()) and back[5].abs().max() == 0


@pytest.mark.parametrize("method", ["int8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_quant_linear_matches_dequantized_reference(method, dtype, rows):
    weight, bias = _weight(), torch.randn(96).to(dtype)  # biases come in the compute dtype
    x = torch.randn(rows, 80, generator=torch.Generator().manual_seed(1)).to(dtype)
    linear = QuantLinear(method, weight, bias)
    dequantized = dequantize(linear.qweight, linear.scale, torch.float32)
    reference = F.linear(x.float(), dequantized, bias.float())
    out = linear(x)
    assert out.dtype == dtype and out.shape == (rows, 96)
    # int8 on CPU runs with bf16 activations; everything else computes in fp32.
    tol = 2e-2 if dtype == torch.bfloat16 or method == "int8" else 1e-5
    torch.testing.assert_close(out.float(), reference, atol=tol * 100, rtol=tol)


def test_quantize_linears_swaps_only_linears():
    model = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.Linear(32, 8, bias=False))
    summary = quantize_linears(model, "int8")
    assert summary.num_linears == 2 and summary.method == "int8"
    assert summary.weight_bytes < summary.full_bytes / 3  # fp32 -> int8 plus scales
    assert isinstance(model[1], nn.LayerNorm) and isinstance(model[2], QuantLinear)
    with pytest.raises(ConfigError, match="quantization='int4'"):
        quantize_linears(model, "int4")


def test_quantized_stage_keeps_embedding_norms_and_logits(tmp_path):
    model_dir = make_tiny_model(tmp_path, tied=True, num_layers=2)
    model = load_quantized_stage(model_dir, stage_spec(2, 1, 0), "bfloat16", "fp8", ignore=())
    assert model.quantization.num_linears == 2 * 4  # qkv, o, gate_up, down per layer
    assert model.embed_tokens.weight.dtype == torch.bfloat16
    assert model.lm_head_weight.dtype == torch.bfloat16
    assert model.norm.weight.dtype == torch.bfloat16
    assert not any(isinstance(m, nn.Linear) for m in model.layers.modules())


@pytest.mark.parametrize("method", ["int8", "fp8"])
def test_quantization_ignore_keeps_projections_in_the_compute_dtype(method, tmp_path):
    model_dir = make_tiny_model(tmp_path, num_layers=2)
    spec = stage_spec(2, 1, 0)
    default = load_quantized_stage(model_dir, spec, "bfloat16", method)
    # fp8 keeps down_proj by default (its inputs carry the massive activations); int8 not.
    kept = ("down_proj",) if method == "fp8" else ()
    assert default.quantization.ignored == kept
    assert default.quantization.num_linears == 2 * (4 - len(kept))
    down = default.layers[1].mlp.down_proj
    assert isinstance(down, QuantLinear) != bool(kept)
    if kept:
        assert type(down) is nn.Linear and down.weight.dtype == torch.bfloat16
    chosen = load_quantized_stage(model_dir, spec, "bfloat16", method, ignore=("qkv_proj",))
    assert chosen.quantization.num_linears == 2 * 3 and chosen.quantization.ignored == ("qkv_proj",)
    assert type(chosen.layers[0].self_attn.qkv_proj) is nn.Linear
    assert isinstance(chosen.layers[0].mlp.down_proj, QuantLinear)


def test_fp8_checkpoint_quantizes_every_projection_unless_told(tmp_path):
    source = make_tiny_model(tmp_path / "src", num_layers=1)
    model_dir = make_fp8_checkpoint(source, tmp_path / "fp8")
    model = load_quantized_stage(model_dir, stage_spec(1, 1, 0), "bfloat16", None)
    assert model.quantization.ignored == () and model.quantization.num_linears == 4
    kept = load_quantized_stage(
        model_dir, stage_spec(1, 1, 0), "bfloat16", None, ignore=("down_proj",)
    )
    down = kept.layers[0].mlp.down_proj  # read as float32 (q * weight_scale), kept in bf16
    assert type(down) is nn.Linear and down.weight.dtype == torch.bfloat16


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).norm() / want.norm())


def _first_logits(model_dir, num_stages: int, **kwargs) -> torch.Tensor:
    runners = make_runners(model_dir, num_stages, **kwargs)
    planner = TinyPlanner(16, 128, chunk_size=7)
    for i, prompt in enumerate(make_prompts(4, seed=5)):
        planner.add(f"r{i}", prompt, 4)
    outputs = run_plans(planner, runners)
    logits = torch.stack([torch.stack(planner.logits[f"r{i}"]) for i in range(4)])
    return logits, outputs


@pytest.mark.parametrize("method", ["int8", "fp8"])
def test_quantized_stages_equal_the_unsplit_quantized_model(method, tmp_path):
    model_dir = make_tiny_model(tmp_path, num_kv_heads=2)
    whole, whole_tokens = _first_logits(model_dir, 1, quantization=method, dtype="bfloat16")
    split, split_tokens = _first_logits(model_dir, 3, quantization=method, dtype="bfloat16")
    assert split_tokens == whole_tokens
    torch.testing.assert_close(split, whole, atol=0, rtol=0)
    full, _ = _first_logits(model_dir, 1, dtype="bfloat16")
    assert not split.equal(full)  # the weights really are quantized
    # First tokens (same inputs). Measured on this random model: int8 0.027, fp8 0.11
    # (e4m3 keeps 3 mantissa bits); bf16 alone 0.013.
    assert _relative_error(split[:, 0], full[:, 0]) < MAX_LOGIT_ERROR[method]


@pytest.mark.parametrize("per_channel", [True, False])
def test_fp8_checkpoint_loads_as_stored(per_channel, tmp_path):
    source = make_tiny_model(tmp_path / "src", num_layers=2)
    model_dir = make_fp8_checkpoint(source, tmp_path / "fp8", per_channel=per_channel)
    assert checkpoint_quantization(model_dir) == "fp8"
    model = load_quantized_stage(model_dir, stage_spec(2, 1, 0), "float32", None)
    assert model.quantization.method == "fp8"
    from safetensors.torch import load_file

    stored = load_file(model_dir / "model.safetensors")
    o_proj = model.layers[1].self_attn.o_proj
    want = stored["model.layers.1.self_attn.o_proj.weight"].float()
    want = want * stored["model.layers.1.self_attn.o_proj.weight_scale"].reshape(-1, 1)
    got = dequantize(o_proj.qweight, o_proj.scale, torch.float32)
    if per_channel:  # the same scales: the same fp8 values
        torch.testing.assert_close(got, want, atol=0, rtol=1e-6)
    else:  # re-quantized per channel from the exact per-tensor values
        torch.testing.assert_close(got, want, atol=1e-6, rtol=2**-4)


def test_fp8_checkpoint_runs_close_to_its_source(tmp_path):
    source = make_tiny_model(tmp_path / "src", num_kv_heads=2)
    model_dir = make_fp8_checkpoint(source, tmp_path / "fp8")
    fp8, _ = _first_logits(model_dir, 2)
    full, _ = _first_logits(source, 2)
    assert _relative_error(fp8[:, 0], full[:, 0]) < MAX_LOGIT_ERROR["fp8"]


def test_unsupported_checkpoint_quantization_is_named(tmp_path):
    import json

    model_dir = make_tiny_model(tmp_path, num_layers=1)
    config = json.loads((model_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4}
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="'awq' is not supported"):
        checkpoint_quantization(model_dir)


def test_worker_config_validates_quantization(tmp_path):
    assert WorkerConfig(str(tmp_path), quantization="int8").quantization == "int8"
    with pytest.raises(ConfigError, match="quantization='int4' is unknown"):
        WorkerConfig(str(tmp_path), quantization="int4")
    assert parse_projections("down_proj, o_proj") == ("down_proj", "o_proj")
    assert parse_projections("none") == () and parse_projections(None) is None
    with pytest.raises(ConfigError, match=r"quantization_ignore names \['mlp'\]"):
        WorkerConfig(str(tmp_path), quantization="fp8", quantization_ignore=("mlp",))


def test_metrics_say_what_is_quantized(tmp_path):
    from types import SimpleNamespace

    from prometheus_client import CollectorRegistry, generate_latest

    from services.worker.observability import QuantizationCollector

    model_dir = make_tiny_model(tmp_path, num_layers=2)
    model = load_quantized_stage(model_dir, stage_spec(2, 1, 0), "float32", "int8")
    servicer = SimpleNamespace(engine=None)
    registry = CollectorRegistry()
    registry.register(QuantizationCollector(0, servicer))
    assert b"quantized" not in generate_latest(registry)  # nothing loaded yet
    servicer.engine = SimpleNamespace(runner=SimpleNamespace(model=model))
    text = generate_latest(registry).decode()
    assert 'conveyor:stage_quantized_linears{quantization="int8",stage="0"} 8.0' in text
    assert f"{model.quantization.weight_bytes}" in text.replace(".0\n", "\n")


def test_fp8_checkpoint_tensor_parallel_shard_reads_its_channels(tmp_path):
    source = make_tiny_model(tmp_path / "src", num_kv_heads=2, num_layers=1)
    model_dir = make_fp8_checkpoint(source, tmp_path / "fp8")
    whole = load_quantized_stage(model_dir, stage_spec(1, 1, 0), "float32", None)
    shard = load_quantized_stage(
        model_dir, stage_spec(1, 1, 0), "float32", None, tp_rank=1, tensor_parallel_size=2
    )

    def qkv(model):
        proj = model.layers[0].self_attn.qkv_proj
        return dequantize(proj.qweight, proj.scale, torch.float32)

    head_dim, spec = whole.config.head_dim, shard.tp.shard
    q, k, v = qkv(whole).split([4 * head_dim, 2 * head_dim, 2 * head_dim])
    q_rows = slice(spec.q_heads[0] * head_dim, spec.q_heads[1] * head_dim)
    kv_rows = slice(spec.kv_heads[0] * head_dim, spec.kv_heads[1] * head_dim)
    # Whole output channels with their own per-channel scales: the same fp8 values.
    torch.testing.assert_close(qkv(shard), torch.cat([q[q_rows], k[kv_rows], v[kv_rows]]))

"""A decode step's layers in one C++ call (`cpu_ops.DecodeStack`, model/llama.py
`decode_stack`): the same bits as the fused layer loop it replaces, and the loop wherever a
layer is not on its kernels."""

from __future__ import annotations

import pytest
import torch

from services.bench.decode_step import decode_case
from services.worker import weights
from services.worker.attention import torch_backend
from services.worker.model import cpu_ops
from services.worker.model.llama import DecoderLayer, fuse_layer
from tests.worker.utils import make_runners, make_tiny_model

pytestmark = pytest.mark.skipif(not cpu_ops.available(), reason="the C++ kernels do not build")


def _hidden_states(runner, step, use_stack: bool) -> torch.Tensor:
    """The stage's output of one decode step, through the stack or the layer loop."""
    model = runner.model
    seen = []
    forward = model.forward

    def capture(*args, **kwargs):
        out = forward(*args, **kwargs)
        seen.append(out.clone())
        return out

    model.forward, model.stack_decode = capture, use_stack
    try:
        step()
    finally:
        model.forward, model.stack_decode = forward, True
    (out,) = seen
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("decode-stack")
    return {
        "llama": make_tiny_model(root / "llama", num_layers=3),
        "qwen2": make_tiny_model(root / "qwen2", arch="qwen2", num_layers=3),  # biases
    }


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize(
    ("dtype", "quantization"),
    [("float32", None), ("bfloat16", None), ("bfloat16", "int8"), ("float32", "int8")],
)
@pytest.mark.parametrize("rows", [1, 4])
def test_the_stack_gives_the_layer_loops_bits(models, arch, dtype, quantization, rows):
    (runner,) = make_runners(
        models[arch], dtype=dtype, quantization=quantization, attention_backend="cpu", onednn=True
    )
    step = decode_case(runner, rows, 37)  # 3 blocks of 16, the last partly filled
    loop = _hidden_states(runner, step, use_stack=False)
    stacked = _hidden_states(runner, step, use_stack=True)
    assert runner.model._stack is not None, "the stage's layers should be on the stack"
    assert runner.model._stack.num_layers == 3
    assert stacked.dtype == loop.dtype and torch.equal(stacked, loop)


def test_a_layer_off_the_kernels_keeps_the_loop(models):
    (runner,) = make_runners(models["llama"], attention_backend="cpu", onednn=True)
    step = decode_case(runner, 2, 20)
    expected = _hidden_states(runner, step, use_stack=True)
    assert runner.model._stack is not None
    layer = runner.model.layers[1]
    layer.self_attn.attend = torch_backend.attend_cached  # a swapped attention function
    assert torch.allclose(_hidden_states(runner, step, use_stack=True), expected, atol=1e-5)
    assert runner.model._stack is None

    (runner,) = make_runners(models["llama"], attention_backend="cpu", onednn=True)
    runner.model.layers[1].mlp.down_proj.small_batch = False  # a matmul on oneDNN
    step = decode_case(runner, 2, 20)
    assert torch.allclose(_hidden_states(runner, step, use_stack=True), expected, atol=1e-5)
    assert runner.model._stack is None


def test_a_layer_swapped_in_gets_a_new_stack(models):
    """A weight update puts fresh layers in (worker/weights.py): the stack built before must
    not keep computing with the old ones."""
    (runner,) = make_runners(models["llama"], attention_backend="cpu", onednn=True)
    (other,) = make_runners(
        make_tiny_model(models["llama"].parent / "seed1", num_layers=3, seed=1),
        attention_backend="cpu",
        onednn=True,
    )
    step = decode_case(runner, 1, 20)
    before = _hidden_states(runner, step, use_stack=True)
    old_stack = runner.model._stack
    fresh: DecoderLayer = other.model.layers[2]
    fuse_layer(fresh, runner.model.layers[2].self_attn.attend)
    runner.model.layers[2] = fresh
    after = _hidden_states(runner, step, use_stack=True)
    assert runner.model._stack is not old_stack
    assert torch.equal(after, _hidden_states(runner, step, use_stack=False))
    assert not torch.equal(after, before)

    # A weight update's commit drops the stack at once: it holds the old layers' weights,
    # and the steps after it may be too large to ask for a new one.
    staged = weights.StagedWeights(1, layers={0: other.model.layers[0]})
    fuse_layer(staged.layers[0], runner.model.layers[0].self_attn.attend)
    weights.commit(runner.model, staged)
    assert runner.model._stack is None and runner.model._stack_key is None
    assert torch.equal(
        _hidden_states(runner, step, use_stack=True), _hidden_states(runner, step, use_stack=False)
    )


def test_the_stack_refuses_what_its_kernels_cannot_take(models):
    (runner,) = make_runners(models["llama"], attention_backend="cpu", onednn=True)
    decode_case(runner, 1, 20)()
    stack = runner.model._stack
    x = torch.zeros(5, 64)
    caches = [torch.zeros(1)] * 3
    with pytest.raises(RuntimeError, match="1 to 4 rows"):
        stack.forward(x, *[torch.zeros(1)] * 4, caches, caches, torch.zeros(1), torch.zeros(1))
    with pytest.raises(RuntimeError, match="one K and one V cache per layer"):
        stack.forward(x[:1], *[torch.zeros(1)] * 4, [], [], torch.zeros(1), torch.zeros(1))

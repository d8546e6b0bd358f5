"""The C++ CPU kernels (model/cpu_ops.py): the small-batch matmul equal to the reference
matmul for every weight format and chosen for 1-4 rows only, the fused elementwise kernels
equal to the eager modules, the bfloat16-cache decode attention equal to torch's, and all
of it switched by --linear-backend."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from services.worker.attention import cpu_backend, torch_backend
from services.worker.config import WorkerConfig
from services.worker.model import cpu_ops
from services.worker.model.layers import RMSNorm, apply_rope
from services.worker.model.packed_linear import PackedLinear, onednn_supported
from services.worker.model.quant import QuantLinear, dequantize

pytestmark = pytest.mark.skipif(not cpu_ops.available(), reason="no C++ compiler here")


@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize("bias", [False, True])
def test_small_linear_float32_equals_f_linear(rows, bias):
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(300, 577, generator=gen)  # K not a multiple of any vector width
    b = torch.randn(300, generator=gen) if bias else None
    x = torch.randn(rows, 577, generator=gen)
    out = cpu_ops.small_linear(x, weight, bias=b)
    torch.testing.assert_close(out, F.linear(x, weight, b), atol=1e-4, rtol=1e-5)


def test_small_linear_bfloat16_weights_widen_exactly():
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(130, 96, generator=gen).bfloat16()
    x = torch.randn(2, 96, generator=gen).bfloat16()
    out = cpu_ops.small_linear(x, weight)
    assert out.dtype == torch.bfloat16
    expected = F.linear(x.float(), weight.float()).bfloat16()  # float32 accumulation
    torch.testing.assert_close(out.float(), expected.float(), atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize("in_features", [576, 1536, 577])
def test_small_linear_bfloat16_dot_equals_the_widening_path(rows, in_features):
    """Where the CPU has AVX512-BF16, bfloat16 x and weights take `vdpbf16ps`: each product
    exact in float32 as in the widening path, only the order of the sums differs. Both
    paths within float32 rounding of the float32 matmul (before the bfloat16 output's
    rounding), with bias and scale; the dot is off where the CPU lacks it. (577: the tails of
    the 128- and 32-wide loops.)"""
    kernels = cpu_ops.load_kernels()
    gen = torch.Generator().manual_seed(rows * in_features)
    weight = torch.randn(200, in_features, generator=gen).bfloat16()
    bias = torch.randn(200, generator=gen).bfloat16()
    x = torch.randn(rows, in_features, generator=gen).bfloat16()
    expected = F.linear(x.float(), weight.float(), bias.float())
    outputs = {}
    try:
        for enabled in (True, False):
            if kernels.use_bf16_dot(enabled) != enabled:
                continue  # no AVX512-BF16 here: only the widening path runs
            outputs[enabled] = cpu_ops.small_linear(x, weight, bias=bias)
    finally:
        kernels.use_bf16_dot(True)
    for out in outputs.values():
        assert out.dtype == torch.bfloat16
        # one bfloat16 rounding of the float32 result (2^-8 relative) and float32 sums
        torch.testing.assert_close(out.float(), expected, atol=1e-3, rtol=2**-8)
    if len(outputs) == 2:  # the rounded outputs agree but for the rare sum near a tie
        assert (outputs[True] != outputs[False]).float().mean() < 0.05


@pytest.mark.parametrize(("rows", "in_features"), [(1, 64), (4, 64), (2, 577), (1, 9000)])
def test_small_linear_int8_applies_the_channel_scale(rows, in_features):
    gen = torch.Generator().manual_seed(rows)
    shape = (200, in_features)  # 577: the tails of the 64/32-wide loops; 9000: float path
    q = torch.randint(-127, 128, shape, generator=gen, dtype=torch.int8)
    scale = torch.rand(200, generator=gen) + 0.1
    x = torch.randn(rows, in_features, generator=gen)
    expected = F.linear(x, dequantize(q, scale, torch.float32))
    # on AVX512-VNNI the activations are rounded to int16 per row (error <= amax / 65534
    # per element): within ~1e-4 of the largest output, far finer than bf16 activations
    atol = 2e-4 * expected.abs().max().item()
    torch.testing.assert_close(cpu_ops.small_linear(x, q, scale), expected, atol=atol, rtol=0)


def test_small_linear_rejects_too_many_rows_and_other_dtypes():
    with pytest.raises(RuntimeError, match="1 to 4 rows"):
        cpu_ops.small_linear(torch.randn(5, 8), torch.randn(3, 8))
    with pytest.raises(RuntimeError, match="float32, bfloat16 or int8 weights"):
        cpu_ops.small_linear(torch.randn(1, 8), torch.randn(3, 8).half())
    assert not cpu_ops.serves(torch.randn(5, 8), torch.randn(3, 8))
    assert cpu_ops.serves(torch.randn(4, 8), torch.randn(3, 8))


@pytest.mark.skipif(not onednn_supported("cpu", torch.float32), reason="no oneDNN")
@pytest.mark.parametrize("rows", [1, 4, 5, 32])
def test_packed_linear_keep_plain_agrees_on_both_paths(rows):
    gen = torch.Generator().manual_seed(rows)
    weight, b = torch.randn(96, 40, generator=gen), torch.randn(96, generator=gen)
    x = torch.randn(rows, 40, generator=gen)
    layer = PackedLinear(weight, b, keep_plain=True)
    assert layer.small_batch and layer.weight is not None
    torch.testing.assert_close(layer(x), F.linear(x, weight, b), atol=1e-4, rtol=1e-5)
    assert PackedLinear(weight, b).weight is None  # without keep_plain: one copy only


AMX_BF16 = cpu_ops.available() and cpu_ops.bf16_pack_amx(torch.zeros(1, 1).bfloat16()) is not None


@pytest.mark.skipif(not AMX_BF16, reason="this CPU has no AMX-BF16")
def test_small_linear_bfloat16_on_amx_tiles_equals_the_matmul_in_any_batch():
    """bf16_pack_amx's copy: 5 to 512 rows on AMX tiles, within a bfloat16 rounding of the
    float32 matmul, with bias; each row the same bits alone (in 5 rows) and in any batch
    (N and K not multiples of the tiles' 32: the padding adds nothing)."""
    gen = torch.Generator().manual_seed(5)
    weight = torch.randn(300, 577, generator=gen).bfloat16()
    bias = torch.randn(300, generator=gen).bfloat16()
    x = torch.randn(512, 577, generator=gen).bfloat16()
    packed = cpu_ops.bf16_pack_amx(weight)
    out = cpu_ops.small_linear(x, weight, bias=bias, packed=packed)
    assert out.dtype == torch.bfloat16 and out.shape == (512, 300)
    expected = F.linear(x.float(), weight.float(), bias.float())
    torch.testing.assert_close(out.float(), expected, atol=1e-3, rtol=2**-8)
    for rows in (5, 17, 64, 100):
        assert torch.equal(
            cpu_ops.small_linear(x[:rows], weight, bias=bias, packed=packed), out[:rows]
        )
    assert torch.equal(
        cpu_ops.small_linear(x[200:205], weight, bias=bias, packed=packed), out[200:205]
    )
    with pytest.raises(RuntimeError, match="up to 512 with bf16_pack_amx"):
        cpu_ops.small_linear(torch.cat([x, x[:1]]), weight, packed=packed)


@pytest.mark.skipif(not AMX_BF16, reason="this CPU has no AMX-BF16")
@pytest.mark.parametrize("rows", [1, 4, 5, 64, 512, 600])
def test_packed_linear_bfloat16_holds_the_amx_copy_instead_of_onednns(rows):
    """With the kernels on, a bfloat16 layer keeps the plain weight and the AMX copy (two
    copies, as with oneDNN's): 1-4 rows on the dot, 5-512 on the tiles, more on torch's
    matmul; the same values either way, as the fused layer loop's `direct` gives them."""
    gen = torch.Generator().manual_seed(rows)
    weight, b = (
        torch.randn(96, 64, generator=gen).bfloat16(),
        torch.randn(96, generator=gen).bfloat16(),
    )
    x = torch.randn(rows, 64, generator=gen).bfloat16()
    layer = PackedLinear(weight, b, keep_plain=True)
    assert layer.amx_weight is not None and layer.packed_weight is None
    assert layer.weight is not None and "amx-bf16" in repr(layer)
    expected = F.linear(x.float(), weight.float(), b.float())
    torch.testing.assert_close(layer(x).float(), expected, atol=1e-2, rtol=2**-7)
    assert torch.equal(layer.direct()(x), layer(x))
    assert PackedLinear(weight, b).amx_weight is None  # without the kernels: oneDNN's copy


@pytest.mark.skipif(not AMX_BF16, reason="this CPU has no AMX-BF16")
def test_packed_linear_amx_copy_leaves_what_its_kernel_cannot_take_to_torch():
    """No rows and a 3-D x go to torch's matmul over the plain weight, as they went to
    oneDNN's before the AMX copy replaced its packed one."""
    gen = torch.Generator().manual_seed(2)
    weight = torch.randn(96, 64, generator=gen).bfloat16()
    layer = PackedLinear(weight, None, keep_plain=True)
    assert layer.amx_weight is not None
    assert layer(torch.zeros(0, 64, dtype=torch.bfloat16)).shape == (0, 96)
    x3 = torch.randn(2, 3, 64, generator=gen).bfloat16()
    torch.testing.assert_close(layer(x3), F.linear(x3, weight))


def test_quant_linear_int8_small_batch_equals_the_int8_kernel():
    gen = torch.Generator().manual_seed(3)
    layer = QuantLinear("int8", torch.randn(256, 128, generator=gen), None)
    x = torch.randn(2, 128, generator=gen).bfloat16()
    small = layer(x)
    layer.small_batch = False  # torch's _weight_int8pack_mm
    torch.testing.assert_close(small.float(), layer(x).float(), atol=0.03, rtol=0.02)


def test_linear_backend_auto_alone_uses_the_small_batch_kernel(tmp_path):
    assert WorkerConfig(str(tmp_path)).uses_cpu_kernels
    assert not WorkerConfig(str(tmp_path), linear_backend="onednn").uses_cpu_kernels
    assert not WorkerConfig(str(tmp_path), linear_backend="torch").uses_cpu_kernels


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_norms_and_silu_mul_equal_the_eager_modules(dtype):
    gen = torch.Generator().manual_seed(5)
    x, delta = (
        torch.randn(5, 96, generator=gen).to(dtype),
        torch.randn(5, 96, generator=gen).to(dtype),
    )
    norm = RMSNorm(96, 1e-5)
    norm.weight.data = torch.randn(96, generator=gen).to(dtype)
    torch.testing.assert_close(
        cpu_ops.rms_norm(x, norm.weight, 1e-5), norm(x), atol=1e-5, rtol=1e-5
    )
    total, normed = cpu_ops.add_rms_norm(x, delta, norm.weight, 1e-5)
    assert torch.equal(total, x + delta)
    torch.testing.assert_close(normed, norm(x + delta), atol=1e-5, rtol=1e-5)
    gate_up = torch.randn(3, 64, generator=gen).to(dtype)
    gate, up = gate_up.split(32, dim=-1)
    torch.testing.assert_close(cpu_ops.silu_mul(gate_up), F.silu(gate) * up, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_of_very_negative_gates_is_zero_not_nan(dtype):
    """exp(-x) overflows for x < -88.7: the kernel (built with -ffast-math) made NaN of x /
    inf there, where torch gives -0; every lane, vector tails included."""
    gate = torch.tensor([-90.0, -124.5, -1e4, -88.0, -5.0, 0.0, 3.0] * 3, dtype=dtype)
    gate_up = torch.cat([gate, torch.full_like(gate, 2.0)])[None]
    ours = cpu_ops.silu_mul(gate_up)
    assert not ours.isnan().any()
    torch.testing.assert_close(ours[0], F.silu(gate) * 2.0, atol=1e-30, rtol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("inter", [1536, 37])  # SmolLM2's, and one that leaves a vector tail
def test_silu_mul_rows_do_not_depend_on_the_batch(dtype, inter):
    """Each element takes the same vector exp wherever it sits (a tail too), so a row's
    bits are the same alone or among others; and they agree with torch's silu."""
    gen = torch.Generator().manual_seed(7)
    gate_up = (torch.randn(19, 2 * inter, generator=gen) * 4).to(dtype)
    batch = cpu_ops.silu_mul(gate_up)
    for row in (0, 7, 18):
        assert torch.equal(cpu_ops.silu_mul(gate_up[row : row + 1]), batch[row : row + 1])
    gate, up = gate_up.float().split(inter, dim=-1)
    want = (F.silu(gate).to(dtype).float() * up).to(dtype)
    tolerance = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(batch, want, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_write_kv_ropes_q_and_k_and_fills_the_cache(dtype):
    gen = torch.Generator().manual_seed(6)
    heads, kv_heads, dim, positions = 4, 2, 16, torch.tensor([3, 0, 41])
    cos, sin = torch.randn(50, dim, generator=gen), torch.randn(50, dim, generator=gen)
    qkv = torch.randn(3, (heads + 2 * kv_heads) * dim, generator=gen).to(dtype)
    k_cache = torch.zeros(4, 8, kv_heads, dim, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.tensor([9, 0, 31])
    q = cpu_ops.rope_write_kv(qkv, cos, sin, positions, k_cache, v_cache, slots, heads, kv_heads)
    q_ref, k_ref, v_ref = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    c, s = cos[positions].to(dtype)[:, None], sin[positions].to(dtype)[:, None]
    torch.testing.assert_close(q, apply_rope(q_ref.view(3, heads, dim), c, s), atol=1e-5, rtol=1e-5)
    flat_k, flat_v = k_cache.view(-1, kv_heads, dim), v_cache.view(-1, kv_heads, dim)
    torch.testing.assert_close(
        flat_k[slots], apply_rope(k_ref.view(3, kv_heads, dim), c, s), atol=1e-5, rtol=1e-5
    )
    assert torch.equal(flat_v[slots], v_ref.reshape(3, kv_heads, dim))
    assert flat_k.abs().sum(-1).sum(-1).count_nonzero() == 3  # nothing else written
    with pytest.raises(RuntimeError, match="outside the RoPE table"):
        cpu_ops.rope_write_kv(
            qkv, cos, sin, positions + 10, k_cache, v_cache, slots, heads, kv_heads
        )
    with pytest.raises(RuntimeError, match="outside the KV cache"):
        cpu_ops.rope_write_kv(
            qkv, cos, sin, positions, k_cache, v_cache, slots + 1, heads, kv_heads
        )


@pytest.mark.parametrize(
    ("head_dim", "num_heads", "num_kv_heads"),
    [(32, 6, 2), (64, 9, 3), (64, 8, 2), (64, 2, 2), (64, 10, 2)],  # 64 x group <= 4: fast path
)
def test_bfloat16_cache_decode_attention_equals_the_torch_reference(
    head_dim, num_heads, num_kv_heads
):
    gen = torch.Generator().manual_seed(7)
    k_cache = torch.randn(12, 16, num_kv_heads, head_dim, generator=gen).bfloat16()
    v_cache = torch.randn(12, 16, num_kv_heads, head_dim, generator=gen).bfloat16()
    q = torch.randn(4, num_heads, head_dim, generator=gen).bfloat16()
    tables = torch.tensor(
        [[0, 5, 7, 0], [1, 2, 3, 4], [9, 0, 0, 0], [6, 0, 0, 0]], dtype=torch.int32
    )
    lens = torch.tensor([40, 64, 3, 1], dtype=torch.int32)
    ours = cpu_backend.decode_attention(q, k_cache, v_cache, tables, lens, 0.2)
    ref = torch_backend.decode_attention(q, k_cache, v_cache, tables, lens, 0.2)
    assert ours.dtype == torch.bfloat16
    torch.testing.assert_close(ours.float(), ref.float(), atol=0.02, rtol=0.02)


@pytest.mark.skipif(not cpu_ops.available(), reason="the C++ kernel does not build here")
@pytest.mark.parametrize(("out_features", "in_features"), [(96, 64), (96, 576), (50, 1000)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_int8_rows_depend_neither_on_the_batch_nor_on_the_instruction_set(
    out_features, in_features, dtype
):
    """Sync and async scheduling batch requests differently: every batch size takes one
    exact integer arithmetic, so a row's output is bit-identical alone and in a batch of 40,
    and AMX (batches of 4 rows on, tiles padded past the 40th row, the 50th channel and the
    1000th input), AVX512-VNNI, AVX2 and plain C++ give the same bits (a CI machine without
    VNNI once gave different tokens to sync and async when bigger batches took torch's
    kernel)."""
    gen = torch.Generator().manual_seed(8)
    bias = torch.randn(out_features, generator=gen).to(dtype)
    layer = QuantLinear("int8", torch.randn(out_features, in_features, generator=gen), bias)
    x = torch.randn(40, in_features, generator=gen).to(dtype)
    kernels = cpu_ops.load_kernels()
    isas = kernels.int8_isas()
    assert (layer.qweight_amx is not None) == ("amx" in isas)
    outputs = {}
    try:
        for isa in isas:
            kernels.use_int8_isa(isa)
            batch = layer(x)
            assert batch.dtype == dtype
            for row in (0, 3, 4, 39):
                assert torch.equal(layer(x[row : row + 1]), batch[row : row + 1]), (isa, row)
            for rows in (3, 4, 7, 16, 17):
                assert torch.equal(layer(x[:rows]), batch[:rows]), (isa, rows)
            assert torch.equal(layer(x[20:]), batch[20:]), isa
            outputs[isa] = batch
    finally:
        kernels.use_int8_isa(isas[0])
    assert all(torch.equal(out, outputs[isas[0]]) for out in outputs.values())
    reference = x.float() @ (layer.qweight.float() * layer.scale[:, None]).T + bias.float()
    torch.testing.assert_close(outputs[isas[0]].float(), reference, atol=0.05, rtol=0.02)


def test_int8_sums_do_not_overflow_at_the_bounds():
    """The largest products (|xq| = 32767, |w| = 127; for AMX's split hi = -128 or 127, lo =
    255) over more k than one int32 chunk holds (2048 for the vector paths, 32768 for AMX)
    sum to the same bits on every path, for decode batches (1 and 4 rows, streamed on
    AVX2) and a bigger one."""
    kernels = cpu_ops.load_kernels()
    isas = kernels.int8_isas()
    in_features = 33000
    q = torch.full((32, in_features), 127, dtype=torch.int8)
    q[1::2] = -127
    x = torch.ones(16, in_features)  # every element the row's amax: xq = +-32767
    x[1::2] = -1
    x[3, ::5] = 0.999
    packed = cpu_ops.int8_pack_amx(q)
    outputs = []
    try:
        for isa in isas:
            kernels.use_int8_isa(isa)
            outputs.append(cpu_ops.small_linear(x, q, packed=packed))
            for rows in (1, 4):
                assert torch.equal(
                    cpu_ops.small_linear(x[:rows], q, packed=packed), outputs[-1][:rows]
                ), (isa, rows)
    finally:
        kernels.use_int8_isa(isas[0])
    assert all(torch.equal(out, outputs[-1]) for out in outputs)
    expected = torch.tensor(127.0 * in_features)  # xq * w * amax / 32767
    torch.testing.assert_close(outputs[0][0, 0], expected, rtol=1e-6, atol=0)


def test_use_int8_isa_refuses_what_this_cpu_cannot_run():
    if not cpu_ops.available():
        pytest.skip("the C++ kernel does not build here")
    with pytest.raises(RuntimeError, match="does not run on this CPU"):
        cpu_ops.load_kernels().use_int8_isa("avx1024")


@pytest.mark.skipif(not cpu_ops.available(), reason="the C++ kernel does not build here")
def test_the_kernels_parallel_loops_use_torchs_threads():
    """The kernels are built with OpenMP: without it at::parallel_for is a plain loop, and a
    worker with --threads 2 ran every kernel on one core (half the decode speed)."""
    kernels = cpu_ops.load_kernels()
    num_threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert kernels.parallel_threads(64) == 2
        torch.set_num_threads(1)
        assert kernels.parallel_threads(64) == 1
    finally:
        torch.set_num_threads(num_threads)


def test_bf16_decode_attention_takes_a_bf16_query_as_the_casts_around_it_would():
    """A bfloat16 q is widened in the kernel and its output rounded like torch's
    .to(bfloat16): the same bits as casting q to float32 before and the output after."""
    gen = torch.Generator().manual_seed(11)
    num_blocks, block_size, num_kv_heads, head_dim, num_heads = 12, 8, 3, 64, 9
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    k_cache, v_cache = k_cache.bfloat16(), v_cache.bfloat16()
    q = torch.randn(3, num_heads, head_dim, generator=gen).bfloat16()
    tables = torch.tensor([[3, 7, 1, 0], [5, 2, 9, 11], [4, 0, 0, 0]], dtype=torch.int32)
    lens = torch.tensor([19, 30, 0], dtype=torch.int32)  # the last one has no context
    kernels = cpu_ops.load_kernels()
    ours = kernels.decode_attention(q, k_cache, v_cache, tables, lens, 0.125)
    cast = kernels.decode_attention(q.float(), k_cache, v_cache, tables, lens, 0.125)
    assert ours.dtype == torch.bfloat16
    assert torch.equal(ours, cast.bfloat16())
    assert not ours[2].any()

"""oneDNN packed matmuls: same results as F.linear, swapped in by use_onednn, chosen by config."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from services.common.errors import ConfigError
from services.worker.config import WorkerConfig
from services.worker.model.packed_linear import PackedLinear, onednn_supported, pack_linears

pytestmark = pytest.mark.skipif(
    not onednn_supported("cpu", torch.float32), reason="torch built without oneDNN"
)


@pytest.mark.parametrize("rows", [1, 7, 64])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_equals_f_linear(rows, bias):
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 40, generator=gen)
    b = torch.randn(96, generator=gen) if bias else None
    x = torch.randn(rows, 40, generator=gen)
    torch.testing.assert_close(
        PackedLinear(weight, b)(x), F.linear(x, weight, b), atol=1e-5, rtol=1e-5
    )


@pytest.mark.skipif(
    not onednn_supported("cpu", torch.bfloat16), reason="this CPU has no oneDNN bf16 path"
)
def test_packed_linear_bfloat16():
    weight, x = torch.randn(64, 32).bfloat16(), torch.randn(5, 32).bfloat16()
    out = PackedLinear(weight)(x)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), F.linear(x, weight).float(), atol=0.05, rtol=0.02)


@pytest.mark.parametrize("keep_plain", [False, True])
@pytest.mark.parametrize("chunk_rows", [10, 1000])
def test_a_dtype_onednn_cannot_pack_keeps_the_plain_weight(monkeypatch, keep_plain, chunk_rows):
    """bfloat16 on a CPU without AVX-512 (oneDNN does not pack it there): the plain weight
    serves every batch, 1-4 rows on `small_linear` with `keep_plain`, bigger batches in
    float32 with the weight widened `chunk_rows` rows at a time (the last block partial)."""
    from services.worker.model import cpu_ops, packed_linear

    monkeypatch.setattr(packed_linear, "onednn_supported", lambda device, dtype: False)
    monkeypatch.setattr(cpu_ops, "bf16_pack_amx", lambda weight: None)  # nor AMX there
    monkeypatch.setattr(packed_linear, "_UPCAST_CHUNK_BYTES", 4 * 40 * chunk_rows)
    gen = torch.Generator().manual_seed(3)
    weight, bias = torch.randn(96, 40, generator=gen).bfloat16(), torch.randn(96).bfloat16()
    layer = PackedLinear(weight, bias, keep_plain=keep_plain)
    assert layer.packed_weight is None and layer.weight is not None
    assert layer.small_batch == (keep_plain and cpu_ops.available())
    assert "plain" in repr(layer)
    for rows in (1, 4, 9):
        x = torch.randn(rows, 40, generator=gen).bfloat16()
        expected = F.linear(x.float(), weight.float(), bias.float())
        for out in (layer(x), layer.direct()(x)):
            assert out.dtype == torch.bfloat16 and out.shape == (rows, 96)
            torch.testing.assert_close(out.float(), expected, atol=0.05, rtol=0.02)


def test_pack_linears_swaps_every_linear_and_keeps_outputs():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.SiLU(), nn.Sequential(nn.Linear(32, 8, bias=False)))
    x = torch.randn(3, 16)
    before = model(x)
    assert pack_linears(model) == 2
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    torch.testing.assert_close(model(x), before, atol=1e-5, rtol=1e-5)


def test_worker_config_resolves_and_validates_the_linear_backend(tmp_path):
    assert WorkerConfig(str(tmp_path)).uses_onednn
    assert not WorkerConfig(str(tmp_path), linear_backend="torch").uses_onednn
    with pytest.raises(ConfigError, match="linear_backend='blas' is unknown"):
        WorkerConfig(str(tmp_path), linear_backend="blas")
    with pytest.raises(ConfigError, match="--linear-backend torch"):
        WorkerConfig(str(tmp_path), linear_backend="onednn", device="cuda")

"""fp8_linear (interpreted Triton) against fp8_linear_ref, and against the quantized layer."""

from __future__ import annotations

import pytest
import torch

from services.kernels.fp8_matmul import fp8_linear
from services.kernels.reference import fp8_linear_ref
from services.worker.model.quant import dequantize, quantize_fp8
from tests.kernels.utils import TOLERANCES, randn


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    ("rows", "in_features", "out_features"),
    [(1, 64, 96), (5, 200, 72), (40, 128, 130), (130, 96, 64)],  # partial tiles in M, N, K
)
def test_fp8_linear_matches_reference(dtype, rows, in_features, out_features):
    weight, scale = quantize_fp8(randn(out_features, in_features, dtype=torch.float32))
    x = randn(rows, in_features, dtype=dtype)
    got = fp8_linear(x, weight, scale)
    assert got.shape == (rows, out_features) and got.dtype == dtype
    tolerance = TOLERANCES[dtype]
    if dtype == torch.float32:  # fp32 accumulation in a different order over K
        tolerance = dict(atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got, fp8_linear_ref(x, weight, scale), **tolerance)


def test_fp8_linear_equals_the_dequantized_weight():
    weight = randn(48, 64, dtype=torch.float32)
    q, scale = quantize_fp8(weight)
    x = randn(3, 64, dtype=torch.float32)
    want = x @ dequantize(q, scale, torch.float32).T
    torch.testing.assert_close(fp8_linear(x, q, scale), want, atol=1e-4, rtol=1e-4)


def test_fp8_linear_rejects_bad_arguments():
    q, scale = quantize_fp8(torch.randn(8, 16))
    with pytest.raises(ValueError, match="weight must be one of"):
        fp8_linear(torch.zeros(2, 16), q.float(), scale)
    with pytest.raises(ValueError, match="weight has size 16 in dim 1, expected 12"):
        fp8_linear(torch.zeros(2, 12), q, scale)
    with pytest.raises(ValueError, match="scale has size 4 in dim 0, expected 8"):
        fp8_linear(torch.zeros(2, 16), q, scale[:4])
    with pytest.raises(ValueError, match="x must be contiguous"):
        fp8_linear(torch.zeros(16, 2).T, q, scale)

"""silu_and_mul (interpreted Triton) against silu_and_mul_ref."""

from __future__ import annotations

import pytest
import torch

from services.kernels.reference import silu_and_mul_ref
from services.kernels.silu_and_mul import silu_and_mul
from tests.kernels.utils import TOLERANCES, randn


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("inter", [24, 1030])  # 1030: two column programs, a partial one
def test_silu_and_mul_matches_reference(dtype, inter):
    x = randn(3, 2 * inter, dtype=dtype)
    got = silu_and_mul(x)
    assert got.shape == (3, inter) and got.dtype == dtype
    torch.testing.assert_close(got, silu_and_mul_ref(x), **TOLERANCES[dtype])


def test_silu_and_mul_rejects_bad_arguments():
    with pytest.raises(ValueError, match="even"):
        silu_and_mul(torch.zeros(2, 7))
    with pytest.raises(ValueError, match="x must have 2 dims"):
        silu_and_mul(torch.zeros(2, 2, 8))
    with pytest.raises(ValueError, match="x must be one of"):
        silu_and_mul(torch.zeros(2, 8, dtype=torch.int32))

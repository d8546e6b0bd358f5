"""rms_norm (interpreted Triton) against rms_norm_ref (Hugging Face LlamaRMSNorm)."""

from __future__ import annotations

import pytest
import torch

from services.kernels.reference import rms_norm_ref
from services.kernels.rms_norm import rms_norm
from tests.kernels.utils import TOLERANCES, randn

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_matches_reference(dtype):
    x = randn(5, 40, dtype=dtype, seed=1)
    weight = randn(40, dtype=dtype, seed=2)
    torch.testing.assert_close(
        rms_norm(x, weight, 1e-5), rms_norm_ref(x, weight, 1e-5), **TOLERANCES[dtype]
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_fused_residual_matches_reference(dtype):
    x, residual = randn(5, 40, dtype=dtype, seed=1), randn(5, 40, dtype=dtype, seed=3)
    weight = randn(40, dtype=dtype, seed=2)
    x_before, residual_before = x.clone(), residual.clone()
    normed, new_residual = rms_norm(x, weight, 1e-6, residual=residual)
    want_normed, want_residual = rms_norm_ref(x, weight, 1e-6, residual=residual)
    if dtype == torch.bfloat16:
        # Triton's interpreter truncates fp32 -> bf16 instead of rounding to nearest even
        # (a GPU rounds), so the rounded sum may be one bf16 ulp off here.
        torch.testing.assert_close(new_residual, want_residual, **TOLERANCES[dtype])
    else:
        assert torch.equal(new_residual, want_residual)  # the add rounds like the model's
    torch.testing.assert_close(normed, want_normed, **TOLERANCES[dtype])
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)


def test_rms_norm_matches_hugging_face():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    hf = LlamaRMSNorm(24, eps=1e-5).to(torch.bfloat16)
    with torch.no_grad():
        hf.weight.copy_(randn(24, dtype=torch.bfloat16, seed=4))
        x = randn(3, 24, dtype=torch.bfloat16)
        torch.testing.assert_close(
            rms_norm(x, hf.weight, 1e-5), hf(x), **TOLERANCES[torch.bfloat16]
        )


def test_rms_norm_rejects_bad_arguments():
    x = torch.zeros(2, 8)
    with pytest.raises(ValueError, match="weight has size 4"):
        rms_norm(x, torch.ones(4), 1e-6)
    with pytest.raises(ValueError, match="weight has dtype"):
        rms_norm(x, torch.ones(8, dtype=torch.float16), 1e-6)
    with pytest.raises(ValueError, match="residual has size 3"):
        rms_norm(x, torch.ones(8), 1e-6, residual=torch.zeros(3, 8))
    with pytest.raises(ValueError, match="contiguous in its last dim"):
        rms_norm(torch.zeros(8, 2).T, torch.ones(8), 1e-6)

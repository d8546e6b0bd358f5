"""rotary_embedding (interpreted Triton) against rotary_embedding_ref and HF apply_rotary_pos_emb."""

from __future__ import annotations

import pytest
import torch

from services.kernels.reference import rotary_embedding_ref
from services.kernels.rotary_embedding import rotary_embedding
from tests.kernels.utils import TOLERANCES, randn


def cos_sin_cache(max_pos: int, head_dim: int, base: float = 10000.0) -> torch.Tensor:
    """[max_pos, D] = [cos | sin] of position * inverse frequency."""
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2).float() / head_dim)
    freqs = torch.arange(max_pos).float()[:, None] * inv_freq[None, :]  # [P, D/2]
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("num_q_heads", "num_kv_heads"), [(2, 2), (6, 2), (3, 1)])
def test_rotary_embedding_matches_reference(dtype, num_q_heads, num_kv_heads):
    positions = torch.tensor([0, 7, 3, 31, 12])
    q = randn(5, num_q_heads, 16, dtype=dtype, seed=1)
    k = randn(5, num_kv_heads, 16, dtype=dtype, seed=2)
    cache = cos_sin_cache(32, 16)
    want_q, want_k = rotary_embedding_ref(positions, q, k, cache)
    got_q, got_k = rotary_embedding(positions, q, k, cache)
    assert got_q is q and got_k is k  # in place
    torch.testing.assert_close(q, want_q, **TOLERANCES[dtype])
    torch.testing.assert_close(k, want_k, **TOLERANCES[dtype])


def test_rotary_embedding_on_fused_qkv_views_matches_hugging_face():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    positions = torch.tensor([4, 5, 6])
    qkv = randn(3, 4 + 2 + 2, 8, dtype=torch.float32)  # [T, Hq + 2 * Hkv, D]
    q, k = qkv[:, :4], qkv[:, 4:6]
    cache = cos_sin_cache(8, 8)
    cos = cache[positions, :4].repeat(1, 2)[None]  # HF: [1, T, D], halves duplicated
    sin = cache[positions, 4:].repeat(1, 2)[None]
    want_q, want_k = apply_rotary_pos_emb(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin
    )
    v_before = qkv[:, 6:].clone()
    rotary_embedding(positions, q, k, cache)
    torch.testing.assert_close(q, want_q[0].transpose(0, 1))
    torch.testing.assert_close(k, want_k[0].transpose(0, 1))
    assert torch.equal(qkv[:, 6:], v_before)  # V untouched


def test_rotary_embedding_rejects_bad_arguments():
    q, k = torch.zeros(2, 2, 8), torch.zeros(2, 1, 8)
    with pytest.raises(ValueError, match="cos_sin_cache has size 6 in dim 1"):
        rotary_embedding(torch.zeros(2, dtype=torch.int64), q, k, torch.zeros(4, 6))
    with pytest.raises(ValueError, match="k must be one of"):
        rotary_embedding(torch.zeros(2, dtype=torch.int64), q, k.half(), torch.zeros(4, 8))
    with pytest.raises(ValueError, match="positions must be one of"):
        rotary_embedding(torch.zeros(2), q, k, torch.zeros(4, 8))

"""reshape_and_cache (interpreted Triton) against reshape_and_cache_ref."""

from __future__ import annotations

import pytest
import torch

from services.kernels.reference import reshape_and_cache_ref
from services.kernels.reshape_and_cache import reshape_and_cache
from tests.kernels.utils import randn


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_reshape_and_cache_matches_reference(dtype, block_size):
    num_blocks, num_kv_heads, head_dim = 4, 3, 24
    k = randn(6, num_kv_heads, head_dim, dtype=dtype, seed=1)
    v = randn(6, num_kv_heads, head_dim, dtype=dtype, seed=2)
    # Scattered slots across blocks, one padding row (-1).
    slots = torch.tensor([3 * block_size + 1, 5, -1, block_size, 2 * block_size - 1, 0])
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    caches = [randn(*shape, dtype=dtype, seed=3) for _ in range(4)]
    reshape_and_cache(k, v, caches[0], caches[1], slots)
    reshape_and_cache_ref(k, v, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


def test_reshape_and_cache_accepts_strided_views():
    # k and v as views of a fused qkv projection [T, 3, Hkv, D].
    qkv = randn(4, 3, 2, 8, dtype=torch.float32)
    k, v = qkv[:, 1], qkv[:, 2]
    caches = [torch.zeros(2, 8, 2, 8) for _ in range(4)]
    slots = torch.tensor([0, 9, 3, 15])
    reshape_and_cache(k, v, caches[0], caches[1], slots)
    reshape_and_cache_ref(k, v, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


def test_reshape_and_cache_rejects_bad_arguments():
    k = torch.zeros(2, 2, 8)
    cache = torch.zeros(2, 8, 2, 8)
    with pytest.raises(ValueError, match="slot_mapping has size 3"):
        reshape_and_cache(k, k, cache, cache, torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="slot_mapping must be one of"):
        reshape_and_cache(k, k, cache, cache, torch.zeros(2))
    with pytest.raises(ValueError, match="k_cache has size 4 in dim 3"):
        reshape_and_cache(k, k, cache[..., :4], cache, torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ValueError, match="v_cache has dtype"):
        reshape_and_cache(k, k, cache, cache.half(), torch.zeros(2, dtype=torch.int64))

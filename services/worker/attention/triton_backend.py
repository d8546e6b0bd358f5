"""Attention backend on the Triton kernels (CUDA): write the new K/V, then paged attention.

Same contract as `services.worker.attention.torch_backend.paged_attention_forward`.
"""

from __future__ import annotations

import torch

from services.kernels.metadata import AttentionMetadata
from services.kernels.paged_attention import paged_attention
from services.kernels.reshape_and_cache import reshape_and_cache


def paged_attention_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Caches k, v at meta.slot_mapping and attends every query row over its sequence.

    Args:
        q: [T, Hq, D]; k, v: [T, Hkv, D] this step's projections (after RoPE).
        k_cache, v_cache: [num_blocks, block_size, Hkv, D] this layer's cache, updated in place.
        meta: the batch (see AttentionMetadata); scale: softmax scale.
    Returns:
        [T, Hq, D] attention output in q's dtype.

    Like the torch backend, a cache of another dtype than q (e.g. an fp32 cache under a
    bf16 stage) is allowed: k, v, q are cast to the cache's dtype, the output back to q's.
    """
    cache_dtype = k_cache.dtype
    reshape_and_cache(k.to(cache_dtype), v.to(cache_dtype), k_cache, v_cache, meta.slot_mapping)
    return paged_attention(q.to(cache_dtype), k_cache, v_cache, meta, scale).to(q.dtype)

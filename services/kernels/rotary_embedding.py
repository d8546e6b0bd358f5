"""Rotary position embedding, NeoX / Hugging Face `rotate_half` style, applied in place.

For each head vector x = [x1 | x2] (halves of D/2) at position p, with the cache row
cos_sin_cache[p] = [cos(p * f) | sin(p * f)] (f: the D/2 inverse frequencies):

    x  ->  [x1 * cos - x2 * sin | x2 * cos + x1 * sin]

The cache is precomputed (e.g. with llama3 frequency scaling), so the kernel knows no
scaling rules. Math in fp32, one rounding to the input dtype.

Reference: `services.kernels.reference.rotary_embedding_ref`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.kernels._checks import check_device, check_tensor, next_power_of_2


@triton.jit
def _rotate_heads(
    x_ptr,
    stride_xh,
    stride_xd,
    cos,
    sin,
    NUM_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HALF_PAD: tl.constexpr,
):
    """Rotates the [NUM_HEADS, 2 * HALF] head vectors at x_ptr in place."""
    offs_h = tl.arange(0, HEADS_PAD)[:, None]
    offs_d = tl.arange(0, HALF_PAD)[None, :]
    mask = (offs_h < NUM_HEADS) & (offs_d < HALF)  # [H, D/2]
    ptr1 = x_ptr + offs_h * stride_xh + offs_d * stride_xd
    ptr2 = ptr1 + HALF * stride_xd
    x1 = tl.load(ptr1, mask=mask, other=0.0)
    x2 = tl.load(ptr2, mask=mask, other=0.0)
    x1f = x1.to(tl.float32)
    x2f = x2.to(tl.float32)
    tl.store(ptr1, (x1f * cos - x2f * sin).to(x1.dtype), mask=mask)
    tl.store(ptr2, (x2f * cos + x1f * sin).to(x1.dtype), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr,
    k_ptr,
    positions_ptr,
    cache_ptr,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_cp,
    NUM_Q_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    Q_HEADS_PAD: tl.constexpr,
    KV_HEADS_PAD: tl.constexpr,
    HALF_PAD: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + t).to(tl.int64)
    offs = tl.arange(0, HALF_PAD)
    cos = tl.load(cache_ptr + pos * stride_cp + offs, mask=offs < HALF, other=0.0).to(tl.float32)
    sin = tl.load(cache_ptr + pos * stride_cp + HALF + offs, mask=offs < HALF, other=0.0).to(
        tl.float32
    )
    _rotate_heads(
        q_ptr + t * stride_qt,
        stride_qh,
        stride_qd,
        cos[None, :],
        sin[None, :],
        NUM_Q_HEADS,
        HALF,
        Q_HEADS_PAD,
        HALF_PAD,
    )
    _rotate_heads(
        k_ptr + t * stride_kt,
        stride_kh,
        stride_kd,
        cos[None, :],
        sin[None, :],
        NUM_KV_HEADS,
        HALF,
        KV_HEADS_PAD,
        HALF_PAD,
    )


def rotary_embedding(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotates q and k **in place** by their tokens' positions; returns (q, k) for chaining.

    Args:
        positions: [T] int64 (or int32) position of each row, < max_pos.
        q: [T, Hq, D] and k: [T, Hkv, D], same float dtype, any strides (e.g. views of a
            fused qkv projection).
        cos_sin_cache: [max_pos, D] float, last dim contiguous: [cos | sin] per position.
    """
    check_tensor("positions", positions, ndim=1, dtypes=(torch.int64, torch.int32))
    num_tokens = positions.shape[0]
    check_tensor("q", q, ndim=3, shape=(num_tokens, None, None))
    head_dim = q.shape[2]
    check_tensor("k", k, ndim=3, dtypes=(q.dtype,), shape=(num_tokens, None, head_dim))
    check_tensor("cos_sin_cache", cos_sin_cache, ndim=2, shape=(None, head_dim))
    if head_dim % 2:
        raise ValueError(f"head_dim must be even for rotary embedding, got {head_dim}")
    if cos_sin_cache.stride(1) != 1:
        raise ValueError("cos_sin_cache must be contiguous in its last dim")
    names = ("positions", "q", "k", "cos_sin_cache")
    check_device(_rotary_kernel, names, (positions, q, k, cos_sin_cache))
    half = head_dim // 2
    if num_tokens > 0:
        _rotary_kernel[(num_tokens,)](
            q,
            k,
            positions,
            cos_sin_cache,
            *q.stride(),
            *k.stride(),
            cos_sin_cache.stride(0),
            NUM_Q_HEADS=q.shape[1],
            NUM_KV_HEADS=k.shape[1],
            HALF=half,
            Q_HEADS_PAD=next_power_of_2(q.shape[1]),
            KV_HEADS_PAD=next_power_of_2(k.shape[1]),
            HALF_PAD=next_power_of_2(half),
        )
    return q, k

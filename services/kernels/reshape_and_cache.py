"""Writes this step's K/V rows into the paged cache at their slots (in place).

Slot s of a cache [num_blocks, block_size, Hkv, D] is block s // block_size, offset
s % block_size. A negative slot marks a padding row: nothing is written for it.

Reference: `services.kernels.reference.reshape_and_cache_ref`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.kernels._checks import check_device, check_same_dtype, check_tensor, next_power_of_2


@triton.jit
def _reshape_and_cache_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_kcd,
    stride_vcb,
    stride_vcs,
    stride_vch,
    stride_vcd,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    offs_h = tl.arange(0, HEADS_PAD)[:, None]
    offs_d = tl.arange(0, HEAD_DIM_PAD)[None, :]
    mask = (offs_h < NUM_KV_HEADS) & (offs_d < HEAD_DIM)  # [H, D]
    k = tl.load(k_ptr + t * stride_kt + offs_h * stride_kh + offs_d * stride_kd, mask=mask)
    v = tl.load(v_ptr + t * stride_vt + offs_h * stride_vh + offs_d * stride_vd, mask=mask)
    kc = k_cache_ptr + block * stride_kcb + offset * stride_kcs
    vc = v_cache_ptr + block * stride_vcb + offset * stride_vcs
    tl.store(kc + offs_h * stride_kch + offs_d * stride_kcd, k, mask=mask)
    tl.store(vc + offs_h * stride_vch + offs_d * stride_vcd, v, mask=mask)


def reshape_and_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Writes k[t], v[t] into k_cache, v_cache at slot slot_mapping[t], in place.

    Args:
        k, v: [T, Hkv, D] new keys and values.
        k_cache, v_cache: [num_blocks, block_size, Hkv, D], same dtype as k.
        slot_mapping: [T] int64 (or int32) slots; negative entries are skipped (padding).
    """
    check_tensor("k", k, ndim=3)
    num_tokens, num_kv_heads, head_dim = k.shape
    check_tensor("v", v, ndim=3, shape=tuple(k.shape))
    check_tensor("k_cache", k_cache, ndim=4, shape=(None, None, num_kv_heads, head_dim))
    check_tensor("v_cache", v_cache, ndim=4, shape=tuple(k_cache.shape))
    check_tensor(
        "slot_mapping", slot_mapping, ndim=1, dtypes=(torch.int64, torch.int32), shape=(num_tokens,)
    )
    check_same_dtype(("k", "v", "k_cache", "v_cache"), (k, v, k_cache, v_cache))
    names = ("k", "v", "k_cache", "v_cache", "slot_mapping")
    check_device(_reshape_and_cache_kernel, names, (k, v, k_cache, v_cache, slot_mapping))
    if num_tokens == 0:
        return
    _reshape_and_cache_kernel[(num_tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        *k.stride(),
        *v.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        HEADS_PAD=next_power_of_2(num_kv_heads),
        HEAD_DIM_PAD=next_power_of_2(head_dim),
        BLOCK_SIZE=k_cache.shape[1],
    )

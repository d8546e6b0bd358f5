"""Paged attention over the block-table KV cache, for decode and mixed (chunked prefill) batches.

One kernel serves every batch shape. A program owns one *query tile* of one sequence for
one KV head: BLOCK_Q query rows times the GROUP query heads that share the KV head (GQA),
flattened into BLOCK_M = BLOCK_Q * GROUP_PAD score rows, so each K/V tile is loaded once
per KV head, not once per query head:

    score row m  ->  query row  q_tile_start + m // GROUP_PAD,  query head  kv_head * GROUP + m % GROUP_PAD

It walks the keys in tiles of TILE_N positions; each key position finds its cache slot
through the block table (`block_table[pos // block_size] * block_size + pos % block_size`),
so tiles may span blocks and the last block may be partial. Query row j of a sequence with
query length L and context length S is at position S - L + j and sees keys 0 .. S - L + j.

Split-K (flash-decoding): when there are too few (query tile, KV head) programs to fill the
GPU, the key range of every tile is cut into NUM_SPLITS contiguous parts run by separate
programs; each writes its normalised partial output and log-sum-exp, and `_combine_kernel`
merges them:  out = sum_j exp(lse_j - max lse) * o_j / sum_j exp(lse_j - max lse).

Reference: `services.kernels.reference.paged_attention_ref`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.kernels._checks import (
    check_device,
    check_same_dtype,
    check_tensor,
    is_interpreted,
    next_power_of_2,
)
from services.kernels.metadata import AttentionMetadata

_LOG2E = 1.4426950408889634


@triton.jit
def _find_seq(query_start_loc_ptr, tile_idx, num_seqs, BLOCK_Q: tl.constexpr):
    """Sequence owning query tile `tile_idx`; sequence i's tiles start at qsl[i] // BLOCK_Q + i."""
    left = 0
    right = num_seqs
    while left < right:
        mid = (left + right) // 2
        first_tile = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_tile <= tile_idx:
            left = mid + 1
        else:
            right = mid
    return left - 1


@triton.jit
def _paged_attention_kernel(
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    num_seqs,
    scale_log2,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_ot,
    stride_oh,
    stride_od,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_kd,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_vd,
    stride_bt,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TILE_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    tile_idx = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq = _find_seq(query_start_loc_ptr, tile_idx, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    q_tile_start = (tile_idx - (q_start // BLOCK_Q + seq)) * BLOCK_Q
    if q_tile_start >= query_len:
        return  # the grid is an upper bound on the number of tiles
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - query_len  # keys already cached before this chunk

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    q_row = q_tile_start + offs_m // GROUP_PAD  # [M] row within the sequence's chunk
    head_in_group = offs_m % GROUP_PAD
    q_head = kv_head * GROUP + head_in_group  # [M]
    row_valid = (q_row < query_len) & (head_in_group < GROUP)
    d_valid = offs_d < HEAD_DIM
    q_pos = context_len + q_row  # [M] position of the row's token; sees keys <= q_pos

    q_ptrs = q_ptr + (q_start + q_row)[:, None] * stride_qt + q_head[:, None] * stride_qh
    q = tl.load(
        q_ptrs + offs_d[None, :] * stride_qd, mask=row_valid[:, None] & d_valid[None, :], other=0.0
    )  # [M, D]
    if DOT_FP32:
        q = q.to(tl.float32)

    # Keys this tile needs: up to its last row's position; this split takes a slice of them.
    kv_len = context_len + tl.minimum(q_tile_start + BLOCK_Q, query_len)
    num_tiles = tl.cdiv(kv_len, TILE_N)
    tiles_per_split = tl.cdiv(num_tiles, NUM_SPLITS)
    tile_lo = split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, num_tiles)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    offs_n = tl.arange(0, TILE_N)
    table_ptr = block_tables_ptr + seq * stride_bt
    for tile in range(tile_lo, tile_hi):
        k_pos = tile * TILE_N + offs_n  # [N]
        k_valid = k_pos < kv_len
        block_id = tl.load(table_ptr + k_pos // BLOCK_SIZE, mask=k_valid, other=0).to(tl.int64)
        in_block = k_pos % BLOCK_SIZE
        kd_mask = d_valid[:, None] & k_valid[None, :]  # [D, N]
        nd_mask = k_valid[:, None] & d_valid[None, :]  # [N, D]
        k_ptrs = k_cache_ptr + block_id[None, :] * stride_kb + in_block[None, :] * stride_ks
        k = tl.load(
            k_ptrs + kv_head * stride_kh + offs_d[:, None] * stride_kd, mask=kd_mask, other=0.0
        )  # [D, N]
        v_ptrs = v_cache_ptr + block_id[:, None] * stride_vb + in_block[:, None] * stride_vs
        v = tl.load(
            v_ptrs + kv_head * stride_vh + offs_d[None, :] * stride_vd, mask=nd_mask, other=0.0
        )  # [N, D]
        if DOT_FP32:
            s = tl.dot(q, k.to(tl.float32), input_precision="ieee")  # [M, N]
        else:
            s = tl.dot(q, k)
        visible = (k_pos[None, :] <= q_pos[:, None]) & k_valid[None, :]
        s = tl.where(visible, s * scale_log2, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no key yet
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])  # [M, N]
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if DOT_FP32:
            acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    acc = acc / l_safe[:, None]
    t_row = q_start + q_row  # [M] flattened token row
    store_mask = row_valid[:, None] & d_valid[None, :]
    if NUM_SPLITS == 1:
        o_ptrs = out_ptr + t_row[:, None] * stride_ot + q_head[:, None] * stride_oh
        tl.store(
            o_ptrs + offs_d[None, :] * stride_od, acc.to(out_ptr.dtype.element_ty), mask=store_mask
        )
    else:
        # Scratch is contiguous: part_out [T, Hq, NUM_SPLITS, HEAD_DIM], part_lse [T, Hq, NUM_SPLITS].
        num_q_heads = tl.num_programs(1) * GROUP
        part_row = (t_row * num_q_heads + q_head) * NUM_SPLITS + split  # [M]
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))  # base 2
        tl.store(part_lse_ptr + part_row, lse, mask=row_valid)
        tl.store(
            part_out_ptr + part_row[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=store_mask
        )


@triton.jit
def _combine_kernel(
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    stride_ot,
    stride_oh,
    stride_od,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
    """Merges the NUM_SPLITS partial results of one (token, query head)."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    row = t * tl.num_programs(1) + h
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    s_valid = offs_s < NUM_SPLITS
    lse = tl.load(
        part_lse_ptr + row * NUM_SPLITS + offs_s, mask=s_valid, other=float("-inf")
    )  # [S]
    lse_max = tl.max(lse, axis=0)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    weight = tl.exp2(lse - lse_max)  # [S]; empty splits weigh 0
    total = tl.sum(weight, axis=0)
    total = tl.where(total == 0.0, 1.0, total)
    o_mask = s_valid[:, None] & (offs_d[None, :] < HEAD_DIM)
    o_ptrs = part_out_ptr + (row * NUM_SPLITS + offs_s)[:, None] * HEAD_DIM + offs_d[None, :]
    parts = tl.load(o_ptrs, mask=o_mask, other=0.0)  # [S, D]
    merged = tl.sum(parts * weight[:, None], axis=0) / total  # [D]
    o_ptrs = out_ptr + t * stride_ot + h * stride_oh + offs_d * stride_od
    tl.store(o_ptrs, merged.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)


def choose_num_splits(num_programs: int, max_seq_len: int, num_sms: int) -> int:
    """Splits of the key range per query tile so that ~2 programs per SM run.

    Only worth it when the (query tile, KV head) programs alone leave SMs idle and the
    context is long: each split keeps at least 256 keys so the combine stays cheap.
    """
    target = 2 * num_sms
    if num_programs >= target:
        return 1
    by_occupancy = triton.cdiv(target, num_programs)
    by_length = max(1, max_seq_len // 256)
    return max(1, min(by_occupancy, by_length, 64))


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Causal attention of every query row over its sequence's paged K/V.

    Args:
        q: [T, Hq, D] queries of the flattened batch (fp16, bf16 or fp32).
        k_cache, v_cache: [num_blocks, block_size, Hkv, D], same dtype as q, already holding
            this step's K/V (see `reshape_and_cache`). Hq must be a multiple of Hkv.
        meta: the batch; uses query_start_loc, seq_lens, block_tables, max_query_len,
            max_seq_len. Rows beyond query_start_loc[-1] (padding) are left unwritten.
        scale: softmax scale, usually D ** -0.5.
        out: optional [T, Hq, D] tensor of q's dtype to write into.
        num_splits: key-range splits per query tile (split-K); None chooses from the
            batch size, context length and the GPU's SM count.
    Returns:
        [T, Hq, D] attention output, in q's dtype (`out` when given).
    """
    num_tokens, num_q_heads, head_dim, num_kv_heads, block_size = _check_args(
        q, k_cache, v_cache, meta, out
    )
    group = num_q_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(q)
    if num_tokens == 0:
        return out
    group_pad = next_power_of_2(group)
    block_q, block_m, tile_n = _tile_config(meta.max_query_len, group_pad, block_size)
    num_seqs = meta.num_seqs
    num_tiles = num_tokens // block_q + num_seqs  # upper bound; extra programs exit at once
    if num_splits is None:
        num_live_tiles = min(num_tiles, num_seqs * triton.cdiv(meta.max_query_len, block_q))
        num_programs = num_live_tiles * num_kv_heads
        num_splits = choose_num_splits(num_programs, meta.max_seq_len, _num_sms(q))
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")

    part_out = part_lse = out  # unused placeholders when there is no split
    if num_splits > 1:
        part_out = q.new_empty((num_tokens, num_q_heads, num_splits, head_dim), dtype=torch.float32)
        part_lse = q.new_empty((num_tokens, num_q_heads, num_splits), dtype=torch.float32)
    block_tables = meta.block_tables.contiguous()
    head_dim_pad = max(16, next_power_of_2(head_dim))
    is_fp32_dot = q.dtype == torch.float32 or is_interpreted(_paged_attention_kernel)
    _paged_attention_kernel[(num_tiles, num_kv_heads, num_splits)](
        out,
        part_out,
        part_lse,
        q,
        k_cache,
        v_cache,
        block_tables,
        meta.seq_lens,
        meta.query_start_loc,
        num_seqs,
        scale * _LOG2E,
        *q.stride(),
        *out.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        block_tables.stride(0),
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        GROUP=group,
        GROUP_PAD=group_pad,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        TILE_N=tile_n,
        BLOCK_SIZE=block_size,
        NUM_SPLITS=num_splits,
        DOT_FP32=is_fp32_dot,
    )
    if num_splits > 1:
        _combine_kernel[(num_tokens, num_q_heads)](
            out,
            part_out,
            part_lse,
            *out.stride(),
            HEAD_DIM=head_dim,
            HEAD_DIM_PAD=next_power_of_2(head_dim),
            NUM_SPLITS=num_splits,
            SPLITS_PAD=next_power_of_2(num_splits),
        )
    return out


def _tile_config(max_query_len: int, group_pad: int, block_size: int) -> tuple[int, int, int]:
    """(BLOCK_Q, BLOCK_M, TILE_N): query rows per program, score rows, keys per step.

    tl.dot needs at least 16 rows, so a decode tile has room for 16 // group_pad query rows
    though its sequence has one (decode is memory bound: the idle rows cost little);
    prefill tiles take 64 score rows and 64 keys per step.
    """
    block_m = 16 if max_query_len == 1 else 64
    block_m = max(block_m, group_pad)
    block_q = block_m // group_pad
    tile_n = max(32 if max_query_len == 1 else 64, next_power_of_2(block_size))
    return block_q, block_m, tile_n


_SM_COUNTS: dict[int, int] = {}


def _num_sms(q: torch.Tensor) -> int:
    """SMs of q's GPU (cached); 1 under the interpreter, where splitting only costs time."""
    if q.device.type != "cuda":
        return 1
    index = q.device.index if q.device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNTS:
        _SM_COUNTS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNTS[index]


def _check_args(q, k_cache, v_cache, meta, out) -> tuple[int, int, int, int, int]:
    """Validates paged_attention's arguments; returns (T, Hq, D, Hkv, block_size)."""
    check_tensor("q", q, ndim=3)
    num_tokens, num_q_heads, head_dim = q.shape
    check_tensor("k_cache", k_cache, ndim=4, shape=(None, None, None, head_dim))
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    check_tensor("v_cache", v_cache, ndim=4, shape=tuple(k_cache.shape))
    check_same_dtype(("q", "k_cache", "v_cache"), (q, k_cache, v_cache))
    if num_q_heads % num_kv_heads != 0:
        raise ValueError(
            f"q has {num_q_heads} heads, not a multiple of the cache's {num_kv_heads} KV heads"
        )
    if not isinstance(meta, AttentionMetadata):
        raise ValueError(f"meta must be an AttentionMetadata, got {type(meta).__name__}")
    ints = (torch.int32, torch.int64)
    num_seqs = meta.seq_lens.shape[0] if isinstance(meta.seq_lens, torch.Tensor) else None
    check_tensor("meta.seq_lens", meta.seq_lens, ndim=1, dtypes=ints)
    check_tensor(
        "meta.query_start_loc", meta.query_start_loc, ndim=1, dtypes=ints, shape=(num_seqs + 1,)
    )
    check_tensor(
        "meta.block_tables", meta.block_tables, ndim=2, dtypes=ints, shape=(num_seqs, None)
    )
    if meta.query_start_loc.stride(0) != 1 or meta.seq_lens.stride(0) != 1:
        raise ValueError("meta.query_start_loc and meta.seq_lens must be contiguous")
    tensors = [q, k_cache, v_cache, meta.seq_lens, meta.query_start_loc, meta.block_tables]
    names = [
        "q",
        "k_cache",
        "v_cache",
        "meta.seq_lens",
        "meta.query_start_loc",
        "meta.block_tables",
    ]
    if out is not None:
        check_tensor("out", out, ndim=3, dtypes=(q.dtype,), shape=tuple(q.shape))
        tensors.append(out)
        names.append("out")
    check_device(_paged_attention_kernel, names, tensors)
    return num_tokens, num_q_heads, head_dim, num_kv_heads, block_size

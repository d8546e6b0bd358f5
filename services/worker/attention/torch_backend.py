"""Paged attention in plain PyTorch: the CPU path, and the reference for the Triton kernels.

One call serves a whole flattened mixed batch (prefill chunks and decodes together):

1. the new K/V rows are written into the paged cache at `slot_mapping`;
2. each sequence's context is gathered from its blocks into a dense [B, L, Hkv, D];
3. `scaled_dot_product_attention` with a boolean causal mask: one batched call for the
   decodes, and one per run of same-shape chunks (never padded, so a row's bits do not
   depend on the other sequences in the batch: `chunk_attention`); a chunk that is a whole
   prompt takes SDPA's own causal path instead, which skips the masked tiles (a bf16
   512-token prompt's prefill step 0.79x the time on an AMX Xeon).

GQA never copies K/V per query head: the G = Hq / Hkv query heads that share a KV head are
folded into the query-length axis, so each KV head is attended once:

    q [B, Q, Hkv*G, D] -> [B, Hkv, Q*G, D]   k, v [B, Hkv, L, D]   mask [B, 1, Q*G, L]
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from services.kernels.metadata import AttentionMetadata

DecodeFn = Callable[..., torch.Tensor]
"""(q [B, Hq, D], k_cache, v_cache, block_tables [B, nb], seq_lens [B], scale) -> [B, Hq, D]"""
KernelChunksFn = Callable[..., torch.Tensor]
"""(q [T, Hq, D], k_cache, v_cache, meta, scale) -> [T, Hq, D] for the chunks a backend's
kernel takes (`TakesChunkFn`): a speculative step's k + 1 positions, and on some CPUs whole
prefill chunks."""
TakesChunkFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""(query_lens [B], seq_lens [B]) -> bool [B]: which chunks go to `kernel_chunks`. It must
decide each sequence by its own lengths: a row's result never depends on its neighbours."""

MAX_SHORT_QUERY_LEN = 32
"""Chunks up to this many rows go to a backend's `kernel_chunks` when it has one and no
`TakesChunkFn` of its own; longer ones (prefill) keep SDPA."""


def short_chunks_only(query_lens: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
    """The default `TakesChunkFn`: chunks of at most MAX_SHORT_QUERY_LEN rows."""
    return query_lens <= MAX_SHORT_QUERY_LEN


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store k, v [T, Hkv, D] in the caches [N, bs, Hkv, D] at slots [T]."""
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def paged_attention_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    decode: DecodeFn | None = None,
    kernel_chunks: KernelChunksFn | None = None,
    takes_chunk: TakesChunkFn = short_chunks_only,
) -> torch.Tensor:
    """Write k, v into the cache, then attend q [T, Hq, D] over the paged context.

    Each row sees its own sequence's tokens up to and including its position (causal within
    the chunk, full over the cached past). Returns [T, Hq, D] in q's dtype. `decode`
    replaces the attention of one-token rows, `kernel_chunks` that of the chunks
    `takes_chunk` picks (the CPU backend passes its C++ kernels).
    """
    write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    return attend_cached(q, k_cache, v_cache, meta, scale, decode, kernel_chunks, takes_chunk)


def attend_cached(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    decode: DecodeFn | None = None,
    kernel_chunks: KernelChunksFn | None = None,
    takes_chunk: TakesChunkFn = short_chunks_only,
) -> torch.Tensor:
    """`paged_attention_forward` once this step's K/V rows are in the cache (the fused CPU
    path writes them with its RoPE kernel, model/cpu_ops.py).

    Each sequence's rows go to one of three paths, by its lengths: 1 query row to `decode`;
    the chunks `takes_chunk` picks to `kernel_chunks` (when given); the rest to SDPA. A
    row's result depends only on its own sequence, never on the others in the batch."""
    decode = decode or decode_attention
    if meta.is_decode_only:
        return decode(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale)
    query_lens = meta.query_lens
    is_decode = query_lens == 1
    if kernel_chunks is None:
        by_kernel = torch.zeros_like(is_decode)
    else:
        by_kernel = (~is_decode) & takes_chunk(query_lens, meta.seq_lens)
    by_sdpa = ~(is_decode | by_kernel)
    if bool(by_kernel.all()):  # every chunk on the kernel (a speculative step, a burst of prompts)
        return kernel_chunks(q, k_cache, v_cache, meta, scale)
    if bool(by_sdpa.all()):
        return chunk_attention(q, k_cache, v_cache, meta, scale)
    out = torch.empty_like(q)
    if bool(is_decode.any()):
        decode_seqs = is_decode.nonzero().squeeze(1)
        decode_rows = meta.query_start_loc[:-1].long()[decode_seqs]
        out[decode_rows] = decode(
            q[decode_rows],
            k_cache,
            v_cache,
            meta.block_tables[decode_seqs],
            meta.seq_lens[decode_seqs],
            scale,
        )
    for kind, attend in ((by_kernel, kernel_chunks), (by_sdpa, chunk_attention)):
        if bool(kind.any()):
            rows, sub = _subset(meta, kind.nonzero().squeeze(1))
            out[rows] = attend(q[rows], k_cache, v_cache, sub, scale)
    return out


def gather_context(
    cache: torch.Tensor, block_tables: torch.Tensor, max_seq_len: int
) -> torch.Tensor:
    """[B, Hkv, L, D] dense context of each sequence (L = max_seq_len; tails are garbage)."""
    block_size = cache.shape[1]
    num_blocks = -(-max_seq_len // block_size)
    table = block_tables[:, :num_blocks]
    # index_select on the flat table is several times faster on CPU than cache[table]
    blocks = cache.index_select(0, table.reshape(-1).long())  # [B * nb, bs, Hkv, D]
    dense = blocks.view(table.shape[0], num_blocks * block_size, *cache.shape[2:])
    return dense[:, :max_seq_len].transpose(1, 2)  # [B, Hkv, L, D]


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One query token per sequence: q [B, Hq, D] -> [B, Hq, D] (the reference)."""
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    max_seq_len = int(seq_lens.max())
    keys = gather_context(k_cache, block_tables, max_seq_len)  # [B, Hkv, L, D]
    values = gather_context(v_cache, block_tables, max_seq_len)
    query = q.view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)  # [B,Hkv,G,D]
    positions = torch.arange(max_seq_len, device=q.device)
    mask = (positions[None, :] < seq_lens[:, None])[:, None, None, :]  # [B, 1, 1, L]
    out = F.scaled_dot_product_attention(
        query, keys.to(q.dtype), values.to(q.dtype), attn_mask=mask, scale=scale
    )  # [B, Hkv, G, D]
    return out.reshape(num_seqs, num_heads, head_dim)


def _subset(
    meta: AttentionMetadata, seq_ids: torch.Tensor
) -> tuple[torch.Tensor, AttentionMetadata]:
    """(rows [T'], metadata) of the sequences `seq_ids` alone."""
    starts = meta.query_start_loc[:-1].long()[seq_ids]
    lens = meta.query_lens.long()[seq_ids]
    rows = _ranges(starts, lens)
    sub = AttentionMetadata(
        positions=meta.positions[rows],
        slot_mapping=meta.slot_mapping[rows],
        query_start_loc=F.pad(lens.cumsum(0), (1, 0)).to(meta.query_start_loc.dtype),
        seq_lens=meta.seq_lens[seq_ids],
        block_tables=meta.block_tables[seq_ids],
        max_query_len=int(lens.max()),
        max_seq_len=int(meta.seq_lens[seq_ids].max()),
    )
    return rows, sub


def chunk_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """General case (prefill chunks): q [T, Hq, D] -> [T, Hq, D], one SDPA call per run of
    consecutive sequences of the same shape (query length, context length), none padded.

    Padding a chunk to a longer neighbour's length changed its bits: SDPA's tiling and
    reductions follow the padded lengths (bfloat16: by an ulp, enough to flip a near-tie
    token), so a request's tokens depended on the batch around it, and sync and async
    scheduling batch requests differently. Unpadded, a row's result is a function of its
    own sequence alone (SDPA computes each batch entry on its own); a benchmark's equal
    prompts still share one call, and mixed lengths no longer pay for padding."""
    starts = meta.query_start_loc.tolist()
    shapes = list(zip(meta.query_lens.tolist(), meta.seq_lens.tolist(), strict=True))
    if shapes.count(shapes[0]) == len(shapes):  # one run (a burst's equal prompts): no copy
        return _same_shape_attention(q, k_cache, v_cache, meta.block_tables, *shapes[0], scale)
    out = torch.empty_like(q)
    first = 0
    for (query_len, seq_len), run in itertools.groupby(shapes):
        count = sum(1 for _ in run)
        rows = slice(starts[first], starts[first + count])
        tables = meta.block_tables[first : first + count]
        out[rows] = _same_shape_attention(
            q[rows], k_cache, v_cache, tables, query_len, seq_len, scale
        )
        first += count
    return out


def _same_shape_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_len: int,
    seq_len: int,
    scale: float,
) -> torch.Tensor:
    """B sequences of one shape: q [B * Q, Hq, D], each chunk the last Q of its L tokens."""
    num_seqs, num_heads, head_dim = block_tables.shape[0], q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    keys = gather_context(k_cache, block_tables, seq_len).to(q.dtype)  # [B, Hkv, L, D]
    values = gather_context(v_cache, block_tables, seq_len).to(q.dtype)
    if query_len == seq_len:  # a whole prompt: SDPA's causal tiling skips the masked tiles
        query = q.view(num_seqs, query_len, num_heads, head_dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(
            query, keys, values, is_causal=True, scale=scale, enable_gqa=group > 1
        )  # [B, Hq, Q, D]: a KV head serves its G query heads without copies
        return out.transpose(1, 2).reshape(num_seqs * query_len, num_heads, head_dim)
    query = q.view(num_seqs, query_len, num_kv_heads, group, head_dim).permute(0, 2, 1, 3, 4)
    query = query.reshape(num_seqs, num_kv_heads, query_len * group, head_dim)
    mask = _chunk_mask(query_len, seq_len, group, q.device)
    out = F.scaled_dot_product_attention(
        query, keys, values, attn_mask=mask, scale=scale
    )  # [B, Hkv, Q*G, D]
    out = out.view(num_seqs, num_kv_heads, query_len, group, head_dim).permute(0, 2, 1, 3, 4)
    return out.reshape(num_seqs * query_len, num_heads, head_dim)


@functools.lru_cache(maxsize=64)
def _chunk_mask(query_len: int, seq_len: int, group: int, device: torch.device) -> torch.Tensor:
    """[Q*G, L] bool: query i (at position L - Q + i) sees keys 0..L - Q + i, each of its G
    query heads alike; made once per shape, not per layer."""
    mask = torch.ones(query_len, seq_len, dtype=torch.bool, device=device)
    return mask.tril(seq_len - query_len).repeat_interleave(group, dim=0)


def _ranges(starts: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    """Concatenation of arange(s, s + n) for each (s, n): [sum(lens)] int64."""
    total = int(lens.sum())
    seq_of = torch.repeat_interleave(torch.arange(lens.shape[0], device=lens.device), lens)
    first = F.pad(lens.cumsum(0), (1, 0))[:-1]
    return torch.arange(total, device=lens.device) - first[seq_of] + starts[seq_of]

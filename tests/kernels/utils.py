"""Factories for kernel tests: random paged caches and the metadata of a mixed batch."""

from __future__ import annotations

import torch

from services.kernels.metadata import AttentionMetadata

TOLERANCES = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2),
}
"""Kernel vs reference, per dtype: both compute in fp32; the rest is output rounding."""


def make_batch(
    seqs: list[tuple[int, int]],
    *,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    seed: int = 0,
    spare_blocks: int = 3,
) -> tuple[AttentionMetadata, torch.Tensor, torch.Tensor]:
    """A batch of sequences given as (context_len_before, query_len), with random K/V cached.

    Blocks are handed out from a shuffled pool (non-contiguous, out-of-order block ids) and
    the whole cache, including the new tokens' slots, holds random K/V; the unused tail of
    each block table is padded with 0. Returns (meta, k_cache, v_cache).
    """
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-(ctx + qlen) // block_size) for ctx, qlen in seqs]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    pool = torch.randperm(num_blocks, generator=gen).tolist()
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    tables = [[pool.pop() for _ in range(n)] for n in blocks_per_seq]
    return metadata_for(seqs, tables, block_size), k_cache, v_cache


def metadata_for(
    seqs: list[tuple[int, int]], tables: list[list[int]], block_size: int
) -> AttentionMetadata:
    """AttentionMetadata of sequences (context_len_before, query_len) with these block ids."""
    block_tables = torch.zeros(len(seqs), max(len(t) for t in tables), dtype=torch.int32)
    positions, slots = [], []
    for i, ((ctx, qlen), table) in enumerate(zip(seqs, tables, strict=True)):
        block_tables[i, : len(table)] = torch.tensor(table, dtype=torch.int32)
        for pos in range(ctx, ctx + qlen):
            positions.append(pos)
            slots.append(table[pos // block_size] * block_size + pos % block_size)
    query_lens = [qlen for _, qlen in seqs]
    return AttentionMetadata(
        positions=torch.tensor(positions, dtype=torch.int64),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start_loc=torch.tensor(
            [0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32
        ),
        seq_lens=torch.tensor([ctx + qlen for ctx, qlen in seqs], dtype=torch.int32),
        block_tables=block_tables,
        max_query_len=max(query_lens),
        max_seq_len=max(ctx + qlen for ctx, qlen in seqs),
    )


def randn(*shape: int, dtype: torch.dtype, seed: int = 1) -> torch.Tensor:
    """Seeded standard-normal tensor of `dtype`."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen).to(dtype)

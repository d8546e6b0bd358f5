"""The references themselves, against the obvious dense computation."""

from __future__ import annotations

import pytest
import torch

from services.kernels.reference import paged_attention_ref, reshape_and_cache_ref
from tests.kernels.utils import make_batch, randn


@pytest.mark.parametrize("num_q_heads", [2, 4])
def test_paged_attention_ref_equals_dense_causal_attention(num_q_heads):
    seqs = [(0, 5), (6, 1), (11, 4)]
    meta, k_cache, v_cache = make_batch(
        seqs, block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.float64
    )
    starts = meta.query_start_loc.tolist()
    q = randn(meta.num_tokens, num_q_heads, 8, dtype=torch.float64)
    wants = []
    for seq, (ctx, qlen) in enumerate(seqs):
        # The sequence's full K/V, written into the cache through its slots.
        seq_len = ctx + qlen
        k = randn(seq_len, 2, 8, dtype=torch.float64, seed=10 + seq)
        v = randn(seq_len, 2, 8, dtype=torch.float64, seed=20 + seq)
        pos = torch.arange(seq_len)
        slots = meta.block_tables[seq, pos // 4].long() * 4 + pos % 4
        reshape_and_cache_ref(k, v, k_cache, v_cache, slots)
        # Dense: all seq_len query rows, causal, then keep the newest qlen rows.
        q_all = torch.randn(seq_len, num_q_heads, 8, dtype=torch.float64)
        q_all[ctx:] = q[starts[seq] : starts[seq + 1]]
        kh = k.repeat_interleave(num_q_heads // 2, dim=1).transpose(0, 1)  # [Hq, S, D]
        vh = v.repeat_interleave(num_q_heads // 2, dim=1).transpose(0, 1)
        dense = torch.nn.functional.scaled_dot_product_attention(
            q_all.transpose(0, 1), kh, vh, is_causal=True, scale=0.3
        ).transpose(0, 1)  # [S, Hq, D]
        wants.append(dense[ctx:])
    # The reference computes in fp32.
    got = paged_attention_ref(q, k_cache, v_cache, meta, 0.3)
    torch.testing.assert_close(got, torch.cat(wants), atol=1e-6, rtol=1e-6)


def test_reshape_and_cache_ref_skips_negative_slots():
    k_cache = torch.zeros(2, 4, 1, 2)
    v_cache = torch.zeros(2, 4, 1, 2)
    k = torch.ones(3, 1, 2)
    reshape_and_cache_ref(k, 2 * k, k_cache, v_cache, torch.tensor([5, -1, 0]))
    assert k_cache.flatten().count_nonzero() == 4
    assert k_cache[1, 1].eq(1).all() and v_cache[0, 0].eq(2).all()

"""Torch paged attention against dense per-sequence causal attention."""

from __future__ import annotations

import random

import pytest
import torch

from services.kernels.metadata import AttentionMetadata
from services.worker.attention.torch_backend import paged_attention_forward


def dense_reference(q, k, v, scale):
    """q [Q, Hq, D] are the last Q of k/v [L, Hkv, D]; causal softmax attention."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.einsum("qhd,lhd->hql", q, k) * scale
    num_q, num_k = q.shape[0], k.shape[0]
    mask = torch.arange(num_k)[None, :] <= torch.arange(num_k - num_q, num_k)[:, None]
    probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
    return torch.einsum("hql,lhd->qhd", probs, v)


@pytest.mark.parametrize("num_kv_heads", [1, 2, 4])
@pytest.mark.parametrize("query_lens", [[1, 1, 1], [5, 1, 9, 1], [7, 3], [6, 6, 6]])
@pytest.mark.parametrize("whole_prompts", [False, True])
def test_paged_attention_matches_dense_attention(num_kv_heads, query_lens, whole_prompts):
    """Chunks after a cached past (the masked SDPA), and whole prompts (SDPA's causal path,
    GQA without copies), in runs of one shape or mixed."""
    torch.manual_seed(0)
    rng = random.Random(1)
    heads, dim, block_size, num_blocks = 4, 16, 8, 64
    past_lens = [0 if whole_prompts else rng.randint(0, 30) for _ in query_lens]
    k_cache = torch.zeros(num_blocks, block_size, num_kv_heads, dim)
    v_cache = torch.zeros_like(k_cache)
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables, slots, positions, full_k, full_v = [], [], [], [], []
    for past, num_q in zip(past_lens, query_lens, strict=True):
        total = past + num_q
        table = [free.pop() for _ in range(-(-total // block_size))]
        tables.append(table)
        seq_slots = [table[p // block_size] * block_size + p % block_size for p in range(total)]
        k_all, v_all = torch.randn(total, num_kv_heads, dim), torch.randn(total, num_kv_heads, dim)
        k_cache.view(-1, num_kv_heads, dim)[seq_slots[:past]] = k_all[:past]
        v_cache.view(-1, num_kv_heads, dim)[seq_slots[:past]] = v_all[:past]
        slots += seq_slots[past:]
        positions += list(range(past, total))
        full_k.append(k_all)
        full_v.append(v_all)
    width = max(len(t) for t in tables)
    meta = AttentionMetadata(
        positions=torch.tensor(positions),
        slot_mapping=torch.tensor(slots),
        query_start_loc=torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()]).int(),
        seq_lens=torch.tensor([p + n for p, n in zip(past_lens, query_lens, strict=True)]).int(),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables]).int(),
        max_query_len=max(query_lens),
        max_seq_len=max(p + n for p, n in zip(past_lens, query_lens, strict=True)),
    )
    q = torch.randn(sum(query_lens), heads, dim)
    new_k = torch.cat([k[-n:] for k, n in zip(full_k, query_lens, strict=True)])
    new_v = torch.cat([v[-n:] for v, n in zip(full_v, query_lens, strict=True)])
    out = paged_attention_forward(q, new_k, new_v, k_cache, v_cache, meta, dim**-0.5)

    start = 0
    for num_q, k_all, v_all in zip(query_lens, full_k, full_v, strict=True):
        expected = dense_reference(q[start : start + num_q], k_all, v_all, dim**-0.5)
        torch.testing.assert_close(out[start : start + num_q], expected, atol=1e-5, rtol=1e-5)
        start += num_q
    torch.testing.assert_close(k_cache.view(-1, num_kv_heads, dim)[slots], new_k)

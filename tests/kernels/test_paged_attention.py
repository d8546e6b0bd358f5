"""paged_attention (interpreted Triton) against paged_attention_ref."""

from __future__ import annotations

import pytest
import torch

from services.kernels.paged_attention import choose_num_splits, paged_attention
from services.kernels.reference import paged_attention_ref
from tests.kernels.utils import TOLERANCES, make_batch, randn

MIXED = [(0, 6), (9, 1), (13, 7), (30, 1)]
"""(cached context, query length): a prompt, two decodes, and a chunk at offset 13."""


def run_both(
    seqs,
    *,
    num_q_heads,
    num_kv_heads,
    block_size,
    dtype=torch.float32,
    head_dim=16,
    num_splits=None,
):
    meta, k_cache, v_cache = make_batch(
        seqs, block_size=block_size, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype
    )
    q = randn(meta.num_tokens, num_q_heads, head_dim, dtype=dtype)
    scale = head_dim**-0.5
    got = paged_attention(q, k_cache, v_cache, meta, scale, num_splits=num_splits)
    return got, paged_attention_ref(q, k_cache, v_cache, meta, scale)


@pytest.mark.parametrize(
    ("num_q_heads", "num_kv_heads", "block_size"),
    [(2, 2, 8), (4, 2, 16), (8, 2, 32), (3, 1, 8)],
    ids=["gqa1-bs8", "gqa2-bs16", "gqa4-bs32", "gqa3-bs8"],
)
def test_paged_attention_mixed_batch_matches_reference(num_q_heads, num_kv_heads, block_size):
    got, want = run_both(
        MIXED, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, block_size=block_size
    )
    torch.testing.assert_close(got, want, **TOLERANCES[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_paged_attention_dtypes_match_reference(dtype):
    got, want = run_both(MIXED, num_q_heads=4, num_kv_heads=2, block_size=8, dtype=dtype)
    assert got.dtype == dtype
    torch.testing.assert_close(got, want, **TOLERANCES[dtype])


def test_paged_attention_decode_only_partial_blocks():
    # Context lengths end mid-block (17, 5, 32 + 1 with block 16).
    got, want = run_both([(16, 1), (4, 1), (32, 1)], num_q_heads=4, num_kv_heads=1, block_size=16)
    torch.testing.assert_close(got, want, **TOLERANCES[torch.float32])


def test_paged_attention_chunked_prefill_at_offset():
    # The second chunk of a 40-token prompt: rows see the 21 cached keys plus a causal prefix.
    got, want = run_both([(21, 19)], num_q_heads=2, num_kv_heads=1, block_size=8)
    torch.testing.assert_close(got, want, **TOLERANCES[torch.float32])


def test_paged_attention_odd_head_dim():
    got, want = run_both([(5, 3), (2, 1)], num_q_heads=2, num_kv_heads=1, block_size=8, head_dim=24)
    torch.testing.assert_close(got, want, **TOLERANCES[torch.float32])


@pytest.mark.parametrize("num_splits", [2, 3, 5])
def test_paged_attention_split_k_decode_matches_reference(num_splits):
    # 70 keys = 3 key tiles: 5 splits leave some splits empty, which must weigh nothing.
    got, want = run_both(
        [(69, 1), (7, 1)], num_q_heads=4, num_kv_heads=2, block_size=16, num_splits=num_splits
    )
    torch.testing.assert_close(got, want, **TOLERANCES[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_paged_attention_split_k_low_precision(dtype):
    got, want = run_both(
        [(40, 1)], num_q_heads=2, num_kv_heads=1, block_size=8, dtype=dtype, num_splits=2
    )
    torch.testing.assert_close(got, want, **TOLERANCES[dtype])


def test_paged_attention_split_k_mixed_batch():
    got, want = run_both(MIXED, num_q_heads=2, num_kv_heads=1, block_size=8, num_splits=2)
    torch.testing.assert_close(got, want, **TOLERANCES[torch.float32])


def test_paged_attention_writes_into_out():
    meta, k_cache, v_cache = make_batch(
        [(3, 2)], block_size=8, num_kv_heads=1, head_dim=16, dtype=torch.float32
    )
    q = randn(meta.num_tokens, 2, 16, dtype=torch.float32)
    out = torch.full_like(q, float("nan"))
    got = paged_attention(q, k_cache, v_cache, meta, 0.25, out=out)
    assert got is out
    torch.testing.assert_close(out, paged_attention_ref(q, k_cache, v_cache, meta, 0.25))


def test_choose_num_splits_only_when_the_gpu_would_idle():
    assert choose_num_splits(num_programs=1024, max_seq_len=8192, num_sms=132) == 1
    assert choose_num_splits(num_programs=8, max_seq_len=100, num_sms=132) == 1  # short
    assert choose_num_splits(num_programs=8, max_seq_len=8192, num_sms=132) == 32
    assert choose_num_splits(num_programs=1, max_seq_len=1 << 20, num_sms=132) == 64


def _args():
    meta, k_cache, v_cache = make_batch(
        [(3, 2)], block_size=8, num_kv_heads=2, head_dim=16, dtype=torch.float32
    )
    return randn(meta.num_tokens, 4, 16, dtype=torch.float32), k_cache, v_cache, meta


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda a: {**a, "q": a["q"][:, :3]}, "not a multiple"),
        (lambda a: {**a, "q": a["q"].half()}, "dtype"),
        (lambda a: {**a, "q": a["q"][0]}, "q must have 3 dims"),
        (lambda a: {**a, "v_cache": a["v_cache"][:-1]}, "v_cache has size"),
        (lambda a: {**a, "k_cache": a["k_cache"][..., :8]}, "k_cache has size 8 in dim 3"),
        (lambda a: {**a, "out": a["q"][:1]}, "out has size"),
        (lambda a: {**a, "out": a["q"].double()}, "out must be one of"),
    ],
    ids=["heads", "dtype", "ndim", "cache-shape", "head-dim", "out-shape", "out-dtype"],
)
def test_paged_attention_rejects_bad_arguments(mutate, message):
    q, k_cache, v_cache, meta = _args()
    args = mutate({"q": q, "k_cache": k_cache, "v_cache": v_cache, "out": None})
    with pytest.raises(ValueError, match=message):
        paged_attention(args["q"], args["k_cache"], args["v_cache"], meta, 0.25, out=args["out"])


def test_paged_attention_rejects_bad_metadata():
    q, k_cache, v_cache, meta = _args()
    meta.seq_lens = meta.seq_lens.float()
    with pytest.raises(ValueError, match="meta.seq_lens"):
        paged_attention(q, k_cache, v_cache, meta, 0.25)

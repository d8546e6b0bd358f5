"""The Triton attention backend (interpreted) against the PyTorch backend, alone and in the model."""

from __future__ import annotations

import pytest
import torch

from services.worker.attention import torch_backend, triton_backend
from tests.kernels.utils import TOLERANCES, make_batch, metadata_for, randn


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_backend_matches_torch_backend(dtype):
    meta, k_cache, v_cache = make_batch(
        [(0, 6), (9, 1), (13, 5)], block_size=8, num_kv_heads=2, head_dim=16, dtype=dtype
    )
    q = randn(meta.num_tokens, 4, 16, dtype=dtype, seed=1)
    k = randn(meta.num_tokens, 2, 16, dtype=dtype, seed=2)
    v = randn(meta.num_tokens, 2, 16, dtype=dtype, seed=3)
    caches = (k_cache.clone(), v_cache.clone())
    got = triton_backend.paged_attention_forward(q, k, v, k_cache, v_cache, meta, 0.25)
    want = torch_backend.paged_attention_forward(q, k, v, *caches, meta, 0.25)
    assert torch.equal(k_cache, caches[0]) and torch.equal(v_cache, caches[1])
    torch.testing.assert_close(got, want, **TOLERANCES[dtype])


def test_triton_backend_casts_to_an_fp32_cache():
    meta, k_cache, v_cache = make_batch(
        [(3, 2)], block_size=8, num_kv_heads=1, head_dim=16, dtype=torch.float32
    )
    q, k, v = (randn(2, n, 16, dtype=torch.bfloat16, seed=s) for n, s in ((2, 1), (1, 2), (1, 3)))
    caches = (k_cache.clone(), v_cache.clone())
    got = triton_backend.paged_attention_forward(q, k, v, k_cache, v_cache, meta, 0.25)
    want = torch_backend.paged_attention_forward(q, k, v, *caches, meta, 0.25)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, want, **TOLERANCES[torch.bfloat16])


def test_tiny_model_forward_with_triton_backend_matches_torch_backend(tmp_path):
    loader = pytest.importorskip("services.worker.model.loader")
    from services.models.tiny import make_tiny_model
    from services.worker.model.stages import stage_spec

    model_dir = make_tiny_model(
        tmp_path / "tiny", num_layers=2, num_heads=4, num_kv_heads=2, vocab_size=512
    )
    stage = stage_spec(2, 1, 0)
    models = {
        name: loader.load_stage_model(model_dir, stage, "float32", attention_backend=name)
        for name in ("torch", "triton")
    }
    block_size, head_dim = 8, models["torch"].config.head_dim
    caches = {
        name: [
            (torch.zeros(8, block_size, 2, head_dim), torch.zeros(8, block_size, 2, head_dim))
            for _ in range(2)
        ]
        for name in models
    }
    tables = [[5, 2], [7, 0, 3]]
    # A prompt and a first prefill chunk, then a decode and the prompt's second chunk.
    for seqs in ([(0, 6), (0, 9)], [(6, 1), (9, 8)]):
        meta = metadata_for(seqs, tables, block_size)
        input_ids = torch.randint(
            3, 512, (meta.num_tokens,), generator=torch.Generator().manual_seed(0)
        )
        with torch.inference_mode():
            out = {
                name: model(meta, caches[name], input_ids=input_ids)
                for name, model in models.items()
            }
        torch.testing.assert_close(out["triton"], out["torch"], atol=1e-4, rtol=1e-4)

"""PyTorch references of every Triton kernel: slow, obvious, and what the tests compare to.

Each `<name>_ref` takes the arguments of the launcher `kernels.<name>.<name>` and computes in
fp32, casting back to the input dtype at the end (except where a step is noted to round
like Hugging Face's Llama does).
"""

from __future__ import annotations

import torch

from services.kernels.metadata import AttentionMetadata


def paged_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """[T, Hq, D]: per sequence, gather its K/V through the block table and attend causally.

    Query row j of a sequence with query length L and context length S sees keys 0..S-L+j.
    """
    out = torch.empty_like(q)
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    group = q.shape[1] // num_kv_heads
    starts = meta.query_start_loc.tolist()
    for seq, seq_len in enumerate(meta.seq_lens.tolist()):
        rows = slice(starts[seq], starts[seq + 1])
        query_len = starts[seq + 1] - starts[seq]
        pos = torch.arange(seq_len, device=q.device)
        slots = meta.block_tables[seq, pos // block_size].long() * block_size + pos % block_size
        k = k_cache.flatten(0, 1)[slots].float().repeat_interleave(group, dim=1)  # [S, Hq, D]
        v = v_cache.flatten(0, 1)[slots].float().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[rows].float(), k) * scale  # [Hq, L, S]
        q_pos = torch.arange(seq_len - query_len, seq_len, device=q.device)
        scores.masked_fill_(pos[None, :] > q_pos[:, None], float("-inf"))
        out[rows] = torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), v).to(q.dtype)
    return out


def reshape_and_cache_ref(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Writes k[t], v[t] ([Hkv, D]) to cache slot slot_mapping[t]; negative slots are skipped."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    k_cache.view(-1, *k_cache.shape[2:])[slots] = k[keep]
    v_cache.view(-1, *v_cache.shape[2:])[slots] = v[keep]


def rms_norm_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Hugging Face LlamaRMSNorm, optionally after the residual add (done in x's dtype).

    Returns normed, or (normed, x + residual) when residual is given.
    """
    if residual is not None:
        x = x + residual
    variance = x.float().pow(2).mean(-1, keepdim=True)
    normed = weight * (x.float() * torch.rsqrt(variance + eps)).to(x.dtype)
    return normed if residual is None else (normed, x)


def rotary_embedding_ref(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """NeoX / HF rotate_half RoPE; returns new (q, k), inputs untouched.

    cos_sin_cache: [max_pos, D], row p = [cos(p * f_0..f_{D/2-1}), sin(p * f_0..f_{D/2-1})].
    """
    half = cos_sin_cache.shape[1] // 2
    cos, sin = cos_sin_cache[positions].float().split(half, dim=-1)  # [T, D/2] each
    cos, sin = cos[:, None, :], sin[:, None, :]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.float().split(half, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)

    return rotate(q), rotate(k)


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """[T, 2I] -> [T, I]: silu(gate) * up with gate = x[:, :I], up = x[:, I:]."""
    gate, up = x.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).to(x.dtype)


def fp8_linear_ref(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """[T, K] x, [N, K] float8_e4m3fn weight, [N] float32 scale -> [T, N] in x's dtype:
    x @ (weight * scale).T, computed in fp32."""
    return (x.float() @ weight.float().T * scale.float()).to(x.dtype)

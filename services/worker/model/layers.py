"""Small building blocks of a Llama-family decoder: RMSNorm, RoPE, SwiGLU MLP.

Every operation mirrors Hugging Face transformers' order of floating-point operations so
that float32 outputs agree with it to the last few bits.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from services.worker.model import cpu_ops
from services.worker.model.config import ModelConfig, RopeScaling
from services.worker.model.tensor_parallel import TensorParallel, single_rank


class RMSNorm(nn.Module):
    """Root-mean-square layer norm, computed in float32 like HF's LlamaRMSNorm."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.fused = False
        """On CPU: one pass of the C++ kernel (model/cpu_ops.py), same operation order."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden]
        if self.fused:
            return cpu_ops.rms_norm(x, self.weight, self.eps)
        dtype = x.dtype
        x = x.to(torch.float32)
        variance = x.pow(2).mean(-1, keepdim=True)  # [T, 1]
        x = x * torch.rsqrt(variance + self.eps)
        return self.weight * x.to(dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """[head_dim // 2] float32 inverse frequencies, with llama3 or linear rescaling applied."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    return _llama3_inv_freq(inv_freq, scaling)


def _llama3_inv_freq(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    """Llama 3.1 frequency rescaling: long wavelengths slowed by `factor`, short kept,
    a smooth blend in between (same formula as transformers' `_compute_llama3_parameters`)."""
    low_freq_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_freq_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """NeoX-style (rotate_half) RoPE with a precomputed cos/sin table per position."""

    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]  # [P, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [P, D]
        self.register_buffer("cos_cache", emb.cos(), persistent=False)
        self.register_buffer("sin_cache", emb.sin(), persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """cos, sin of shape [T, 1, D] for `positions` [T], ready to broadcast over heads."""
        cos = self.cos_cache[positions].to(dtype)[:, None, :]
        sin = self.sin_cache[positions].to(dtype)[:, None, :]
        return cos, sin


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x` [T, H, D] by the angles in cos/sin [T, 1, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)  # rotate_half
    return (x * cos) + (rotated * sin)


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)) with gate and up fused into one matmul.

    Tensor parallel: gate/up hold this rank's I/T columns, down the matching rows, and the
    partial sums are all-reduced (model/tensor_parallel.py)."""

    def __init__(self, config: ModelConfig, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.tp = tp or single_rank(config)
        hidden, inter = config.hidden_size, self.tp.shard.intermediate_size
        self.intermediate_size = inter
        self.gate_up_proj = nn.Linear(hidden, 2 * inter, bias=config.mlp_bias)
        self.down_proj = nn.Linear(inter, hidden, bias=config.mlp_bias and self.tp.rank == 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden]
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)  # [T, I/tp] x 2
        return self.tp.all_reduce(self.down_proj(F.silu(gate) * up))

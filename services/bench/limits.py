"""What this machine can do at most, measured by the bench itself, and what a workload asks.

    peak matmul GF/s   the worker's own matmuls (`PackedLinear`: oneDNN packed weights, or
                       bfloat16 widened to float32 where oneDNN has no bfloat16, on CPUs
                       without AVX-512) on every core, in the benched dtype, the best of a
                       few large shapes
    memory read GB/s   a sum over a tensor far larger than the caches, on every core

The workload model (`WorkModel`, from the model's config.json) turns these into bounds: its
FLOPs over the peak give the highest throughput the compute allows, and the bytes one decode
step reads (every weight once, plus the request's KV) over the bandwidth give the lowest
ms/token one request can reach. Each row of the comparison reports its share of them.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

_MATMUL_SHAPES = ((1024, 2048, 2048), (2048, 576, 3072), (512, 4096, 4096))  # rows, in, out
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2}


@dataclass(frozen=True, slots=True)
class MachineLimits:
    matmul_gflops: float
    read_gbps: float
    threads: int
    dtype: str


def _best_seconds(fn, min_total_s: float = 0.3, repeats: int = 5) -> float:
    fn()  # warm-up: packing, page faults, thread pool start
    best = float("inf")
    for _ in range(repeats):
        count, start = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - start) < min_total_s / repeats or count == 0:
            fn()
            count += 1
        best = min(best, elapsed / count)
    return best


def measure_limits(dtype: str = "float32", threads: int | None = None) -> MachineLimits:
    """Peak matmul GF/s and memory read GB/s on `threads` (default: every core)."""
    import torch

    from services.worker.model.packed_linear import PackedLinear

    threads = threads or os.cpu_count() or 1
    torch_dtype = getattr(torch, dtype)
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        gflops = 0.0
        for rows, k, n in _MATMUL_SHAPES:
            x = torch.randn(rows, k, dtype=torch_dtype)
            matmul = functools.partial(PackedLinear(torch.randn(n, k, dtype=torch_dtype)), x)
            gflops = max(gflops, 2 * rows * k * n / _best_seconds(matmul) / 1e9)
        big = torch.ones(256 * 2**20 // 4 * 4, dtype=torch.float32)  # 1 GiB
        gbps = big.numel() * 4 / _best_seconds(lambda: big.sum(), min_total_s=1.0) / 1e9
    finally:
        torch.set_num_threads(saved)
    return MachineLimits(round(gflops, 1), round(gbps, 1), threads, dtype)


@dataclass(frozen=True, slots=True)
class WorkModel:
    """A decoder-only transformer's matmul work, from its config.json."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int

    @classmethod
    def from_model_dir(cls, model_dir: Path) -> WorkModel:
        config = json.loads((Path(model_dir) / "config.json").read_text())
        heads = config["num_attention_heads"]
        return cls(
            layers=config["num_hidden_layers"],
            hidden=config["hidden_size"],
            heads=heads,
            kv_heads=config.get("num_key_value_heads", heads),
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
            intermediate=config["intermediate_size"],
            vocab=config["vocab_size"],
        )

    @property
    def layer_params(self) -> int:
        q_out = self.heads * self.head_dim
        kv_out = 2 * self.kv_heads * self.head_dim
        return (
            self.hidden * (q_out + kv_out)
            + q_out * self.hidden
            + 3 * self.hidden * self.intermediate
        )

    @property
    def logits_params(self) -> int:
        return self.hidden * self.vocab

    def token_flops(self, context: int, logits: bool) -> float:
        """One token's FLOPs at position `context` (attention reads `context` keys)."""
        attention = 4 * self.layers * self.heads * self.head_dim * context
        return (
            2 * self.layers * self.layer_params
            + attention
            + (2 * self.logits_params if logits else 0)
        )

    def request_flops(self, input_len: int, output_len: int) -> float:
        """Prefill (logits for its last token only) and output_len - 1 decode steps."""
        prefill = sum(self.token_flops(c, False) for c in range(1, input_len + 1))
        prefill += 2 * self.logits_params
        decode = sum(self.token_flops(input_len + i, True) for i in range(1, output_len))
        return prefill + decode

    def decode_bytes(self, context: int, dtype: str) -> float:
        """What one request's decode step reads: every weight once, plus its KV."""
        size = _DTYPE_BYTES[dtype]
        weights = self.layers * self.layer_params + self.logits_params
        kv = 2 * self.layers * self.kv_heads * self.head_dim * context
        return (weights + kv) * size

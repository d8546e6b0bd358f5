"""The paged KV cache of one stage's layers.

Per layer, K and V each are `[num_blocks, block_size, num_kv_heads, head_dim]` (see
attention/metadata.py). The number of blocks comes from a memory budget in bytes:

    bytes_per_block = 2 (K and V) * num_layers * block_size * num_kv_heads * head_dim * itemsize
    num_blocks      = budget // bytes_per_block

Block ids are the scheduler's: every stage holds the same number of blocks only if every
stage gets the same budget per layer; the scheduler sizes its pool to the smallest stage.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from services.common.errors import ConfigError
from services.common.units import format_bytes
from services.worker.config import BLOCK_SIZES

logger = logging.getLogger(__name__)


@dataclass(slots=True, frozen=True)
class KVCacheSpec:
    """Shape of one stage's paged cache."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    def __post_init__(self) -> None:
        if self.block_size not in BLOCK_SIZES:
            raise ConfigError(
                f"block_size={self.block_size} is not supported: use one of {BLOCK_SIZES}"
            )

    @property
    def bytes_per_block(self) -> int:
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * itemsize

    def blocks_per_seq(self, max_model_len: int) -> int:
        return -(-max_model_len // self.block_size)

    def num_blocks_for(self, budget_bytes: int, max_model_len: int) -> int:
        """Blocks that fit in `budget_bytes`; ConfigError if one max-length sequence does not."""
        num_blocks = budget_bytes // self.bytes_per_block
        needed = self.blocks_per_seq(max_model_len)
        if num_blocks < needed:
            raise ConfigError(
                f"kv_cache_memory={format_bytes(budget_bytes)} ({budget_bytes} bytes) holds "
                f"{num_blocks} blocks of {self.bytes_per_block} bytes each "
                f"({self.num_layers} layers x block_size {self.block_size}), but one sequence of "
                f"max_model_len={max_model_len} needs {needed} blocks "
                f"({needed * self.bytes_per_block} bytes): raise --kv-cache-memory or lower "
                f"--max-model-len"
            )
        return num_blocks


class KVCache:
    """K and V tensors of every layer of one stage."""

    def __init__(self, spec: KVCacheSpec, num_blocks: int, device: str | torch.device = "cpu"):
        self.spec, self.num_blocks = spec, num_blocks
        shape = (num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = [
            (
                torch.zeros(shape, dtype=spec.dtype, device=device),
                torch.zeros(shape, dtype=spec.dtype, device=device),
            )
            for _ in range(spec.num_layers)
        ]
        logger.info(
            "KV cache: %d blocks x %d tokens, %d layers, %s",
            num_blocks,
            spec.block_size,
            spec.num_layers,
            format_bytes(self.num_bytes),
        )

    @classmethod
    def from_budget(
        cls,
        spec: KVCacheSpec,
        budget_bytes: int,
        max_model_len: int,
        device: str | torch.device = "cpu",
    ) -> KVCache:
        return cls(spec, spec.num_blocks_for(budget_bytes, max_model_len), device)

    @property
    def block_size(self) -> int:
        return self.spec.block_size

    @property
    def num_bytes(self) -> int:
        return self.num_blocks * self.spec.bytes_per_block

"""The explicit description of one flattened mixed batch, passed to every attention call.

KV cache layout (per layer, K and V separately):

    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]

A slot is `block_id * block_size + offset`; the token at position p of a sequence lives in
slot `block_table[p // block_size] * block_size + p % block_size`.

A batch of B sequences is flattened into T = sum(query_lens) rows. Sequence i owns rows
query_start_loc[i] : query_start_loc[i + 1]; those are its newest tokens, at positions
seq_lens[i] - query_len_i ... seq_lens[i] - 1 (a prefill chunk, or one decode token).

    rows:      | seq 0 (chunk of 5) | seq 1 (decode) | seq 2 (chunk of 3) |
    qsl:       0                    5                6                    9
    seq_lens:  [5 + already cached,  ctx_1 + 1,       3 + already cached]
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class AttentionMetadata:
    positions: torch.Tensor
    """[T] int64: position of each row's token in its sequence."""
    slot_mapping: torch.Tensor
    """[T] int64: KV cache slot each row's new K/V is written to."""
    query_start_loc: torch.Tensor
    """[B + 1] int32: cumulative query lengths; rows of sequence i start at query_start_loc[i]."""
    seq_lens: torch.Tensor
    """[B] int32: each sequence's context length including this step's tokens."""
    block_tables: torch.Tensor
    """[B, max_num_blocks] int32: block ids of each sequence, padded with 0."""
    max_query_len: int
    """Longest query of the batch (1 when every sequence decodes)."""
    max_seq_len: int
    """Longest context of the batch."""

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.positions.shape[0]

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1

    @property
    def query_lens(self) -> torch.Tensor:
        """[B] int32."""
        return self.query_start_loc[1:] - self.query_start_loc[:-1]

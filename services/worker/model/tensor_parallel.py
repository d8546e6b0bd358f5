"""Tensor parallelism inside a stage (Megatron-style): which shard a rank holds, and the
three collectives a sharded stage runs.

A stage of T ranks splits every decoder layer so that each rank holds 1/T of its weights:

    x [T_tok, H] (replicated) ─┬─ qkv (columns: its heads) ─ attention ─ o_proj (rows) ─┐
                               │                                         all-reduce (sum)┘
                               └─ gate/up (columns: I/T) ─ silu·mul ─ down (rows) ─ all-reduce

Attention heads are dealt out in whole GQA groups: with K KV heads and K >= T each rank
takes a contiguous run of KV heads (K/T; when T does not divide K, the first K % T ranks
take one more) and the query heads that read them. With K < T each KV head is replicated
on T/K ranks and its query heads are split among them (T must then be a multiple of K and
the group size H/K a multiple of T/K). The vocabulary (embedding rows, lm_head rows) is
split in T equal ranges: the embedding all-reduces masked lookups, the logits are gathered
to rank 0 so the sampler sees the whole row.

Biases of row-parallel projections live on rank 0 only, so the all-reduce adds them once.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from services.common.errors import ConfigError
from services.worker.model.config import ModelConfig

MAX_TENSOR_PARALLEL = 64


@dataclass(slots=True, frozen=True)
class TensorShard:
    """The slices of a model one rank holds: [start, end) in heads, rows or vocab ids."""

    rank: int
    size: int
    q_heads: tuple[int, int]
    kv_heads: tuple[int, int]
    intermediate: tuple[int, int]
    vocab: tuple[int, int]

    @property
    def num_heads(self) -> int:
        return self.q_heads[1] - self.q_heads[0]

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads[1] - self.kv_heads[0]

    @property
    def intermediate_size(self) -> int:
        return self.intermediate[1] - self.intermediate[0]

    @property
    def vocab_size(self) -> int:
        return self.vocab[1] - self.vocab[0]


def check_tensor_parallel(config: ModelConfig, size: int, source: str = "the model") -> None:
    """Raises ConfigError naming the numbers when `size` ranks cannot shard `config`."""
    if not 1 <= size <= MAX_TENSOR_PARALLEL:
        raise ConfigError(
            f"tensor_parallel_size={size} is out of range: must be in [1, {MAX_TENSOR_PARALLEL}]"
        )
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    if kv_heads < size:
        if size % kv_heads:
            raise ConfigError(
                f"tensor_parallel_size={size} cannot share {source}'s num_key_value_heads="
                f"{kv_heads}: with fewer KV heads than ranks, the ranks must be a multiple of "
                "the KV heads"
            )
        group, replicas = heads // kv_heads, size // kv_heads
        if group % replicas:
            raise ConfigError(
                f"tensor_parallel_size={size}: {source}'s {group} query heads per KV head "
                f"(num_attention_heads={heads}, num_key_value_heads={kv_heads}) do not split "
                f"over the {replicas} ranks that share each KV head"
            )
    for name, value in (
        ("intermediate_size", config.intermediate_size),
        ("vocab_size", config.vocab_size),
    ):
        if value % size:
            raise ConfigError(
                f"tensor_parallel_size={size} does not divide {source}'s {name}={value}"
            )


def tensor_shard(config: ModelConfig, rank: int, size: int) -> TensorShard:
    """The shard of `rank` in a stage of `size` ranks (after `check_tensor_parallel`)."""
    check_tensor_parallel(config, size)
    if not 0 <= rank < size:
        raise ConfigError(f"tp_rank={rank} is out of range: must be in [0, {size - 1}]")
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    group = heads // kv_heads
    if kv_heads >= size:
        counts = [kv_heads // size + (1 if i < kv_heads % size else 0) for i in range(size)]
        kv_start = sum(counts[:rank])
        kv = (kv_start, kv_start + counts[rank])
        q = (kv[0] * group, kv[1] * group)
    else:
        replicas = size // kv_heads
        kv_head, part = divmod(rank, replicas)
        kv = (kv_head, kv_head + 1)
        per_rank = group // replicas
        q_start = kv_head * group + part * per_rank
        q = (q_start, q_start + per_rank)
    inter = config.intermediate_size // size
    vocab = config.vocab_size // size
    return TensorShard(
        rank,
        size,
        q,
        kv,
        (rank * inter, (rank + 1) * inter),
        (rank * vocab, (rank + 1) * vocab),
    )


class TensorParallel:
    """A rank's place in its stage and the stage's process group.

    The group is per session (it is formed with the pipeline's, and re-formed with it):
    `StageEngine` sets `group` when a session connects. With size 1 every collective is the
    identity and no group is needed.
    """

    def __init__(self, shard: TensorShard) -> None:
        self.shard = shard
        self.group: dist.ProcessGroup | None = None
        self.comm_ns = 0
        """Time spent in collectives (wall-clock ns, summed); the all-reduce's share of a step."""

    @property
    def rank(self) -> int:
        return self.shard.rank

    @property
    def size(self) -> int:
        return self.shard.size

    def _group(self) -> dist.ProcessGroup:
        if self.group is None:
            raise RuntimeError(f"tp rank {self.rank}/{self.size} has no process group yet")
        return self.group

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of `x` over the stage's ranks, in place."""
        if self.size > 1:
            self._timed(lambda: self._group().allreduce([x]).wait())
        return x

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor | None:
        """[N, V/T] on every rank -> [N, V] on rank 0 (in rank order), None elsewhere."""
        if self.size == 1:
            return x
        x = x.contiguous()
        outputs = [[torch.empty_like(x) for _ in range(self.size)]] if self.rank == 0 else []
        options = dist.GatherOptions()
        options.rootRank = 0
        self._timed(lambda: self._group().gather(outputs, [x], options).wait())
        return torch.cat(outputs[0], dim=-1) if self.rank == 0 else None

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's `x` on every rank (in place)."""
        if self.size > 1:
            options = dist.BroadcastOptions()
            options.rootRank = 0
            self._timed(lambda: self._group().broadcast([x], options).wait())
        return x

    def _timed(self, op) -> None:
        start = time.perf_counter_ns()
        op()
        self.comm_ns += time.perf_counter_ns() - start


def single_rank(config: ModelConfig) -> TensorParallel:
    """The trivial TensorParallel of an unsharded stage."""
    return TensorParallel(tensor_shard(config, 0, 1))


class VocabParallelEmbedding(nn.Module):
    """Embedding rows [vocab_start, vocab_end) on this rank; the others' rows come from the
    all-reduce of masked lookups (each id is found on exactly one rank)."""

    def __init__(self, tp: TensorParallel, hidden_size: int) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_start, self.vocab_end = tp.shard.vocab
        self.weight = nn.Parameter(
            torch.empty(tp.shard.vocab_size, hidden_size), requires_grad=False
        )

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden]
        is_local = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local_ids = (input_ids - self.vocab_start).masked_fill(~is_local, 0)
        x = F.embedding(local_ids, self.weight).masked_fill(~is_local[:, None], 0.0)
        return self.tp.all_reduce(x)

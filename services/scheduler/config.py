"""Scheduler configuration: one validated dataclass, vLLM's names where the idea is the same."""

from __future__ import annotations

from dataclasses import dataclass

from services.common.errors import ConfigError

POLICIES = ("fcfs", "priority", "fair")
SCHEDULING_MODES = ("async", "sync")


@dataclass(slots=True)
class SchedulerConfig:
    """How the scheduler plans steps. Built once from CLI flags and passed down.

    Every field is validated in `__post_init__`; a bad value raises `ConfigError` naming the
    value and the allowed range.
    """

    num_blocks: int
    """KV blocks in the pool, reported by the workers (the smallest stage decides). One block
    id names the same slots on every stage."""
    block_size: int = 16
    """Tokens per KV block (`--block-size`)."""
    max_num_seqs: int = 256
    """Most requests in one step (one micro-batch) (`--max-num-seqs`)."""
    max_num_batched_tokens: int = 2048
    """Most tokens computed in one step: decodes count 1, prefill chunks their length."""
    max_model_len: int = 2048
    """Longest sequence (prompt + output) a request may reach (`--max-model-len`)."""
    enable_prefix_caching: bool = True
    """Reuse KV blocks of identical prompt prefixes (`--enable-prefix-caching`)."""
    enable_chunked_prefill: bool = True
    """Split long prompts across steps under the token budget (`--enable-chunked-prefill`)."""
    policy: str = "fcfs"
    """Waiting-queue order: `fcfs`, `priority` (lower value first) or `fair` (weighted
    fair share of tokens across tenants) (`--scheduler-policy`)."""
    scheduling: str = "async"
    """`async`: plan a request's next decode before its token came back (stage 0 gets the
    token from the last stage); `sync`: wait for the token (`--scheduling`)."""
    num_stages: int = 1
    """Pipeline stages P (`--pipeline-parallel-size`): a request that sampled at step s is
    scheduled again at step s + P at the earliest."""
    max_waiting: int = 10_000
    """Most requests waiting in the queue; one more raises `QueueFull`."""

    def __post_init__(self) -> None:
        _at_least("num_blocks", self.num_blocks, 1)
        _at_least("block_size", self.block_size, 1)
        _at_least("max_num_seqs", self.max_num_seqs, 1)
        _at_least("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        _at_least("max_model_len", self.max_model_len, 2)
        _at_least("num_stages", self.num_stages, 1)
        _at_least("max_waiting", self.max_waiting, 1)
        if self.policy not in POLICIES:
            raise ConfigError(f"policy={self.policy!r} is not known: use one of {POLICIES}")
        if self.scheduling not in SCHEDULING_MODES:
            raise ConfigError(
                f"scheduling={self.scheduling!r} is not known: use one of {SCHEDULING_MODES}"
            )
        if self.num_blocks * self.block_size < self.max_model_len:
            raise ConfigError(
                f"num_blocks={self.num_blocks} x block_size={self.block_size} = "
                f"{self.num_blocks * self.block_size} KV slots cannot hold one sequence of "
                f"max_model_len={self.max_model_len}: give the KV cache more memory or lower "
                "--max-model-len"
            )
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ConfigError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} < max_model_len="
                f"{self.max_model_len} with chunked prefill off: long prompts could never be "
                "scheduled; raise --max-num-batched-tokens or enable chunked prefill"
            )

    @property
    def is_async(self) -> bool:
        return self.scheduling == "async"


def _at_least(name: str, value: int, low: int) -> None:
    if not isinstance(value, int) or value < low:
        raise ConfigError(f"{name}={value!r} is out of range: must be an integer >= {low}")

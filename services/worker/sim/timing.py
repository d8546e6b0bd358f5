"""The timing model: how long one stage's step takes on a hardware profile.

A step runs the stage's L decoder layers over T tokens of B sequences (sequence i computes
q_i tokens and ends at context c_i = cached + q_i), and on the last stage the logits of the
N rows that sample. Per TP rank (t ranks; w = bytes per element of the profile's dtype):

    linear     FLOPs 2 T P / t                    bytes P w / t + activations
    attention  FLOPs 4 (h / t) d sum_i k_i        bytes (sum_i c_i + T) kv + T 2 (h / t) d w
               k_i = q_i (c_i - q_i) + q_i (q_i + 1) / 2   (keys each query sees, causal)
               kv  = 2 ceil(h_kv / t) d w          (K and V of one token in one layer)
    logits     FLOPs 2 N H V / t                  bytes V H w / t + 2 N V 4 / t (fp32 out, read)
    embedding  (stage 0)                          bytes 2 T H w
    all-reduce (t > 1) 2 per layer of T H w bytes: latency + 2 (t - 1) / t bytes / bus bw

with P the weights of one layer, h / h_kv / d the query heads / KV heads / head size, H the
hidden size, V the vocabulary. Each operator takes

    max(FLOPs / (peak x compute eff), bytes / (bandwidth x memory eff))   (GPU profiles)
    FLOPs / (peak x compute eff) + bytes / (bandwidth x memory eff)       (CPU: overlap off)

On a GPU an operator's compute and memory traffic overlap (a roofline: the larger wins);
on a CPU core they come from one instruction stream and add up (the calibration against
real SmolLM2 steps fits the sum, not the max). Operators run one after another, so their
times add:

    step = L (linear + attention + all-reduce) + logits + embedding
           + step_overhead + L layer_overhead + B seq_overhead

A decode step of a large model is memory-bound (the weights are read once per step,
whatever B), a long prefill chunk compute-bound. Activations between stages take
link_latency + T H w / link_bandwidth (transport.py applies it on the receiving side).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from services.common.errors import ConfigError
from services.common.units import format_bytes
from services.worker.model.config import ModelConfig
from services.worker.sim.profiles import HardwareProfile

LOGITS_BYTES = 4  # logits are float32 whatever the model's dtype


@dataclass(slots=True)
class StepCost:
    """Modeled seconds of one step on one stage, by part; `total_s` is the step."""

    linear_s: float = 0.0
    attention_s: float = 0.0
    logits_s: float = 0.0
    embedding_s: float = 0.0
    allreduce_s: float = 0.0
    overhead_s: float = 0.0
    is_linear_compute_bound: bool = False

    @property
    def total_s(self) -> float:
        return (
            self.linear_s
            + self.attention_s
            + self.logits_s
            + self.embedding_s
            + self.allreduce_s
            + self.overhead_s
        )


class StageTimingModel:
    """Times the steps of one stage (its layers, and the logits when it is the last)."""

    def __init__(
        self,
        model: ModelConfig,
        profile: HardwareProfile,
        num_layers: int,
        is_first: bool = True,
        is_last: bool = True,
        tensor_parallel_size: int = 1,
    ) -> None:
        if tensor_parallel_size < 1:
            raise ConfigError(f"tensor_parallel_size={tensor_parallel_size} must be >= 1")
        self.model, self.profile = model, profile
        self.num_layers, self.is_first, self.is_last = num_layers, is_first, is_last
        self.tp = tensor_parallel_size
        self.w = profile.dtype_bytes
        m = model
        self._layer_weight_bytes = m.num_layer_params * self.w / self.tp
        # per token: read input + write output of qkv, o, gate/up, down (SwiGLU reads 2I)
        q_size, kv_size = m.num_attention_heads * m.head_dim, m.num_key_value_heads * m.head_dim
        self._layer_act_bytes_per_token = self.w * (
            4 * m.hidden_size + (2 * q_size + 2 * kv_size + 6 * m.intermediate_size) / self.tp
        )
        self._heads = m.num_attention_heads / self.tp
        self._kv_token_bytes = 2 * -(-m.num_key_value_heads // self.tp) * m.head_dim * self.w

    # ------------------------------------------------------------------ sizes
    @property
    def weight_bytes(self) -> float:
        """Weights of this stage on one TP rank (layers, embedding, final norm + lm_head)."""
        m = self.model
        total = self.num_layers * self._layer_weight_bytes
        table = m.vocab_size * m.hidden_size * self.w / self.tp
        if self.is_first:
            total += table
        if self.is_last and (not self.is_first or not m.tie_word_embeddings):
            total += table
        return total

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token in every layer of this stage, on one TP rank."""
        return self.num_layers * self._kv_token_bytes

    def num_kv_blocks(self, block_size: int, budget_bytes: int | None, max_model_len: int) -> int:
        """KV blocks this stage holds: the profile's memory x utilization minus the weights
        (or `budget_bytes` when the profile has no memory size: the CPU's --kv-cache-memory),
        over the bytes of one block. Raises ConfigError when one max-length sequence does
        not fit."""
        p = self.profile
        if p.memory_bytes is None:
            if budget_bytes is None:
                raise ConfigError(f"profile {p.name!r} has no memory size: give a KV budget")
            budget, where = budget_bytes, f"kv_cache_memory={format_bytes(budget_bytes)}"
        else:
            usable = p.memory_bytes * p.memory_utilization
            budget = int(usable - self.weight_bytes)
            where = (
                f"{p.name}'s {format_bytes(p.memory_bytes)} x {p.memory_utilization} minus "
                f"{format_bytes(int(self.weight_bytes))} of weights"
            )
        block_bytes = block_size * self.kv_bytes_per_token
        num_blocks = max(budget, 0) // block_bytes
        needed = -(-max_model_len // block_size)
        if num_blocks < needed:
            raise ConfigError(
                f"{where} leaves {num_blocks} KV blocks of {block_bytes} bytes; one "
                f"{max_model_len}-token sequence needs {needed}: use more stages, "
                "--sim-tensor-parallel-size, a larger profile or a smaller --max-model-len"
            )
        return int(num_blocks)

    # ------------------------------------------------------------------ time
    def step(
        self, query_lens: Sequence[int], seq_lens: Sequence[int], num_sampled: int
    ) -> StepCost:
        """Modeled time of one step: `query_lens[i]` tokens of sequence i computed this step,
        ending at context `seq_lens[i]`; `num_sampled` rows take logits (last stage)."""
        p, m, L = self.profile, self.model, self.num_layers
        num_tokens = sum(query_lens)
        cost = StepCost()
        if num_tokens:
            flops = 2.0 * num_tokens * m.num_layer_params / self.tp
            bytes_ = self._layer_weight_bytes + num_tokens * self._layer_act_bytes_per_token
            compute_s, memory_s = self._compute_s(flops), self._memory_s(bytes_)
            cost.linear_s = L * self._combine(compute_s, memory_s)
            cost.is_linear_compute_bound = compute_s > memory_s
            cost.attention_s = L * self._attention_s(query_lens, seq_lens)
            if self.tp > 1:
                message = num_tokens * m.hidden_size * self.w
                ring = 2 * (self.tp - 1) / self.tp * message / p.tp_bandwidth
                cost.allreduce_s = L * 2 * (p.tp_latency_s + ring)
            if self.is_first:
                cost.embedding_s = self._memory_s(2.0 * num_tokens * m.hidden_size * self.w)
        if self.is_last and num_sampled:
            table = m.vocab_size * m.hidden_size / self.tp
            flops = 2.0 * num_sampled * table
            bytes_ = table * self.w + 2.0 * num_sampled * m.vocab_size / self.tp * LOGITS_BYTES
            cost.logits_s = self._combine(self._compute_s(flops), self._memory_s(bytes_))
        cost.overhead_s = (
            p.step_overhead_s + L * p.layer_overhead_s + len(query_lens) * p.seq_overhead_s
        )
        return cost

    def transfer_s(self, num_tokens: int) -> float:
        """Activations [T, H] of one step to the next stage over the profile's link."""
        num_bytes = num_tokens * self.model.hidden_size * self.w
        return self.profile.link_latency_s + num_bytes / self.profile.link_bandwidth

    def token_transfer_s(self, num_tokens: int) -> float:
        """Sampled token ids (int64) from the last stage to stage 0."""
        return self.profile.link_latency_s + 8 * num_tokens / self.profile.link_bandwidth

    def _attention_s(self, query_lens: Sequence[int], seq_lens: Sequence[int]) -> float:
        p, d = self.profile, self.model.head_dim
        keys = 0
        for q, c in zip(query_lens, seq_lens, strict=True):
            keys += q * (c - q) + q * (q + 1) // 2
        num_tokens = sum(query_lens)
        flops = 4.0 * self._heads * d * keys
        bytes_ = (sum(seq_lens) + num_tokens) * self._kv_token_bytes + (
            num_tokens * 2 * self._heads * d * self.w
        )
        compute_s = flops / (p.peak_flops * p.attention_compute_efficiency)
        memory_s = bytes_ / (p.memory_bandwidth * p.attention_memory_efficiency)
        return self._combine(compute_s, memory_s)

    def _combine(self, compute_s: float, memory_s: float) -> float:
        return max(compute_s, memory_s) if self.profile.overlap else compute_s + memory_s

    def _compute_s(self, flops: float) -> float:
        return flops / (self.profile.peak_flops * self.profile.compute_efficiency)

    def _memory_s(self, num_bytes: float) -> float:
        return num_bytes / (self.profile.memory_bandwidth * self.profile.memory_efficiency)

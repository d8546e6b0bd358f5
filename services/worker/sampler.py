"""Batched sampler of the last pipeline stage: logits [N, V] -> one token per request.

Order (as vLLM):

    raw logits ──▶ min_tokens mask ──▶ penalties ──┬──▶ greedy rows: argmax
                                                   └──▶ random rows: / temperature ─▶ ...

    ... ─▶ min_p ─▶ top_k ─▶ top_p ─▶ softmax ─▶ argmax(probs / q),  q ~ Exp(1) per token

The min_tokens mask sets EOS and stop_token_ids to -inf in the rows still under min_tokens
(vLLM's MinTokensLogitsProcessor); rows without min_tokens are left untouched.

Sampling with exponential noise is the Gumbel-max trick: argmax(p_i / q_i) is distributed as
p. A seeded request draws q from a generator seeded with (seed, k), k = the number of output
tokens so far, so its k-th token depends on nothing else: not the batch around it, not a
preemption and recompute, not which worker process samples it (on the same device type).
Every per-row step is an exact no-op for rows that do not use it (top_p=1, top_k=0, min_p=0,
neutral penalties), so a row's result does not depend on which fast paths the batch takes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from services.common.sampling import SamplingParams
from services.common.step import TokenLogprobs

_MASK64 = (1 << 64) - 1


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x [N, V] -> [N] int64: each row's first maximum, as `x.argmax(dim=-1)` (a NaN counts
    as the maximum). On CPU, float32 and bfloat16 rows go to the C++ kernel
    (`cpu_ops.argmax_rows`), else float32 ones through numpy: torch's CPU argmax over
    SmolLM2's 49152-wide rows took 0.12 ms for one row and 9.5 ms for 64 (torch 2.13, 2
    threads), numpy's 8 us and 0.64 ms, the kernel 0.25 ms for 64 and 0.17 ms for 64
    bfloat16 rows, which numpy cannot read (widened for it where the kernels do not build;
    docs/performance.md#the-argmax-of-the-logits)."""
    if x.device.type != "cpu" or x.dim() != 2 or x.dtype not in (torch.float32, torch.bfloat16):
        return x.argmax(dim=-1)
    from services.worker.model import cpu_ops  # builds the kernels: not at import

    if x.shape[1] and cpu_ops.available():
        return cpu_ops.argmax_rows(x)
    return torch.from_numpy(x.detach().float().numpy().argmax(axis=-1))  # bf16: widened


@dataclass(slots=True)
class SamplingBatch:
    """Per-request sampling settings of one step, as tensors built once on `device`.

    Penalty token ids are stored flat (row index, token id) for the rows that use penalties
    only; they become [N, V] counts with one scatter_add when the vocabulary size is known.
    """

    temperatures: torch.Tensor  # [N] float32; 1.0 for greedy rows (never divided by 0)
    is_greedy: torch.Tensor  # [N] bool
    top_p: torch.Tensor  # [N] float32; 1.0 disables
    top_k: torch.Tensor  # [N] int64; 0 disables
    min_p: torch.Tensor  # [N] float32; 0.0 disables
    repetition_penalties: torch.Tensor  # [N] float32; 1.0 disables
    presence_penalties: torch.Tensor  # [N] float32
    frequency_penalties: torch.Tensor  # [N] float32
    prompt_rows: torch.Tensor  # [P] int64: row of each prompt token (penalised rows only)
    prompt_tokens: torch.Tensor  # [P] int64
    output_rows: torch.Tensor  # [O] int64: row of each output token (penalised rows only)
    output_tokens: torch.Tensor  # [O] int64
    masked_rows: torch.Tensor  # [M] int64: row of each token masked out (before min_tokens)
    masked_tokens: torch.Tensor  # [M] int64: EOS and stop_token_ids of rows under min_tokens
    seeds: list[int | None]
    """Per-request seed; None draws from the sampler's global generator."""
    num_output_tokens: list[int]
    """k of each request: output tokens so far, i.e. the index of the token sampled now."""
    num_logprobs: list[int | None]
    """Top-n logprobs asked by each request; None asks for none."""
    all_greedy: bool
    all_random: bool
    any_penalties: bool
    any_top_k: bool
    any_top_p: bool
    any_min_p: bool

    @property
    def num_requests(self) -> int:
        return len(self.seeds)

    @property
    def max_num_logprobs(self) -> int | None:
        """Largest n asked for, or None when no request wants logprobs."""
        asked = [n for n in self.num_logprobs if n is not None]
        return max(asked) if asked else None

    @classmethod
    def from_requests(
        cls,
        params: list[SamplingParams],
        prompt_token_ids: list[list[int]],
        output_token_ids: list[list[int]],
        device: torch.device | str = "cpu",
        eos_token_ids: Sequence[int] = (),
    ) -> SamplingBatch:
        """Build the batch; row i of the logits belongs to params[i].

        Args:
            params: sampling parameters, one per row.
            prompt_token_ids: each request's prompt (for the repetition penalty).
            output_token_ids: each request's tokens generated so far (penalties and the
                seeded generator's position k).
            device: where the logits live.
            eos_token_ids: the ids that finish requests (the model's EOS ids, as the
                scheduler's), masked out with stop_token_ids until a request has min_tokens
                output tokens.
        """
        if not len(params) == len(prompt_token_ids) == len(output_token_ids):
            raise ValueError(
                f"sampling batch needs one entry per request: got {len(params)} params, "
                f"{len(prompt_token_ids)} prompts, {len(output_token_ids)} outputs"
            )

        def floats(values: list[float]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.float32, device=device)

        greedy = [p.is_greedy for p in params]
        penalised = [i for i, p in enumerate(params) if p.has_penalties]
        prompt_rows, prompt_tokens = _flatten(prompt_token_ids, penalised, device)
        output_rows, output_tokens = _flatten(output_token_ids, penalised, device)
        random = [p for p in params if not p.is_greedy]
        masked = [
            p.masked_token_ids(len(ids), eos_token_ids)
            for p, ids in zip(params, output_token_ids, strict=True)
        ]
        masked_rows, masked_tokens = _flatten(masked, range(len(masked)), device)
        return cls(
            temperatures=floats([1.0 if p.is_greedy else p.temperature for p in params]),
            is_greedy=torch.tensor(greedy, dtype=torch.bool, device=device),
            top_p=floats([p.top_p for p in params]),
            top_k=torch.tensor([p.top_k for p in params], dtype=torch.int64, device=device),
            min_p=floats([p.min_p for p in params]),
            repetition_penalties=floats([p.repetition_penalty for p in params]),
            presence_penalties=floats([p.presence_penalty for p in params]),
            frequency_penalties=floats([p.frequency_penalty for p in params]),
            prompt_rows=prompt_rows,
            prompt_tokens=prompt_tokens,
            output_rows=output_rows,
            output_tokens=output_tokens,
            masked_rows=masked_rows,
            masked_tokens=masked_tokens,
            seeds=[p.seed for p in params],
            num_output_tokens=[len(ids) for ids in output_token_ids],
            num_logprobs=[p.logprobs for p in params],
            all_greedy=all(greedy),
            all_random=not any(greedy),
            any_penalties=bool(penalised),
            any_top_k=any(p.top_k > 0 for p in random),
            any_top_p=any(p.top_p < 1.0 for p in random),
            any_min_p=any(p.min_p > 0.0 for p in random),
        )


@dataclass(slots=True)
class SamplerOutput:
    """Sampled tokens of one step, in batch order."""

    token_ids: torch.Tensor  # [N] int64
    logprobs: list[TokenLogprobs | None] | None
    """Per row, or None when no request asked for logprobs."""


class Sampler:
    """Samples one token per row of the last stage's logits.

    Args:
        seed: seeds the global generator used by requests without their own seed
            (vLLM's `--seed`); None uses torch's default generator.
        device: device of that global generator (the logits' device).
    """

    def __init__(self, seed: int | None = None, device: torch.device | str = "cpu") -> None:
        self.generator: torch.Generator | None = None
        if seed is not None:
            self.generator = torch.Generator(device=device)
            self.generator.manual_seed(seed)

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        """Sample from `logits` [N, V] float32 (not modified).

        Logprobs are vLLM's default "raw" logprobs: log_softmax of the logits passed in,
        before penalties, temperature and truncation.
        """
        if logits.dim() != 2 or logits.shape[0] != batch.num_requests:
            raise ValueError(
                f"logits of shape {tuple(logits.shape)} do not match a batch of "
                f"{batch.num_requests} requests: expected [{batch.num_requests}, V]"
            )
        processed = logits.float()
        if batch.masked_rows.numel():
            processed = processed.clone()  # `logits` stay raw for the logprobs
            processed[batch.masked_rows, batch.masked_tokens] = float("-inf")
        if batch.any_penalties:
            processed = apply_penalties(processed, batch)  # [N, V], a new tensor
        if batch.all_greedy:
            token_ids = argmax_rows(processed)  # [N]
        elif batch.all_random:
            token_ids = self._sample_random(processed, batch, rows=None)
        else:
            token_ids = argmax_rows(processed)
            rows = (~batch.is_greedy).nonzero().squeeze(1)  # [R]
            token_ids[rows] = self._sample_random(processed[rows], batch, rows)
        logprobs = None
        if batch.max_num_logprobs is not None:
            logprobs = gather_logprobs(logits, token_ids, batch.num_logprobs)
        return SamplerOutput(token_ids=token_ids, logprobs=logprobs)

    def _sample_random(
        self, logits: torch.Tensor, batch: SamplingBatch, rows: torch.Tensor | None
    ) -> torch.Tensor:
        """Sample the random rows `rows` (None: all rows); `logits` [R, V] holds those rows."""

        def pick(values: torch.Tensor) -> torch.Tensor:
            return values if rows is None else values[rows]

        logits = logits / pick(batch.temperatures).unsqueeze(1)  # [R, V]
        if batch.any_min_p:
            logits = apply_min_p(logits, pick(batch.min_p))
        if batch.any_top_k or batch.any_top_p:
            top_k = pick(batch.top_k) if batch.any_top_k else None
            top_p = pick(batch.top_p) if batch.any_top_p else None
            logits = apply_top_k_top_p(logits, top_k, top_p)
        probs = logits.softmax(dim=-1)  # [R, V]
        row_ids = range(batch.num_requests) if rows is None else rows.tolist()
        noise = self._exponential_noise(probs, batch, row_ids)  # [R, V]
        return argmax_rows(probs.div_(noise))  # [R]

    def _exponential_noise(
        self, probs: torch.Tensor, batch: SamplingBatch, row_ids: range | list[int]
    ) -> torch.Tensor:
        """q ~ Exp(1) [R, V]: per-(seed, k) generators for seeded rows, global for the rest."""
        noise = torch.empty_like(probs)
        seeds = [batch.seeds[i] for i in row_ids]
        unseeded = [j for j, seed in enumerate(seeds) if seed is None]
        if len(unseeded) == len(seeds):
            return noise.exponential_(generator=self.generator)
        if unseeded:
            index = torch.tensor(unseeded, device=probs.device)
            draw = probs.new_empty(len(unseeded), probs.shape[1])
            noise[index] = draw.exponential_(generator=self.generator)
        for j, (i, seed) in enumerate(zip(row_ids, seeds, strict=True)):
            if seed is not None:
                generator = torch.Generator(device=probs.device)
                generator.manual_seed(mix_seed(seed, batch.num_output_tokens[i]))
                noise[j].exponential_(generator=generator)
        return noise


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Repetition (prompt + output tokens), then frequency and presence (output tokens only).

    Returns a new [N, V] tensor; rows with neutral penalties come out bit-identical.
    """
    num_rows, vocab_size = logits.shape
    output_counts = _token_counts(batch.output_rows, batch.output_tokens, num_rows, vocab_size)
    prompt_counts = _token_counts(batch.prompt_rows, batch.prompt_tokens, num_rows, vocab_size)
    is_seen = (output_counts > 0) | (prompt_counts > 0)  # [N, V]
    penalty = batch.repetition_penalties.unsqueeze(1)  # [N, 1]
    penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
    logits = torch.where(is_seen, penalised, logits)
    logits = logits - batch.frequency_penalties.unsqueeze(1) * output_counts
    return logits - batch.presence_penalties.unsqueeze(1) * (output_counts > 0)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask tokens whose probability is below min_p [R] times the row's top probability."""
    probs = logits.softmax(dim=-1)  # [R, V]
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)  # [R, 1]
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Mask all but the top_k [R] tokens, then all outside the top_p [R] nucleus; one sort.

    top_k 0 and top_p 1 leave a row as it is. Ties at the k-th value are all kept.
    """
    vocab_size = logits.shape[1]
    sorted_logits, order = logits.sort(dim=-1)  # [R, V] ascending
    if top_k is not None:
        k = torch.where(top_k > 0, top_k.clamp(max=vocab_size), vocab_size)  # [R]
        kth_value = sorted_logits.gather(1, (vocab_size - k).unsqueeze(1))  # [R, 1]
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth_value, float("-inf"))
    if top_p is not None:
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)  # [R, V]
        outside = cumulative <= (1 - top_p).unsqueeze(1)
        outside[:, -1] = False  # the top token always stays
        sorted_logits = sorted_logits.masked_fill(outside, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def gather_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, num_logprobs: list[int | None]
) -> list[TokenLogprobs | None]:
    """Raw logprobs: log_softmax of `logits` [N, V]; top-n sorted by logprob, descending."""
    logprobs = logits.float().log_softmax(dim=-1)  # [N, V]
    max_n = max(n for n in num_logprobs if n is not None)
    top_values, top_ids = logprobs.topk(max_n, dim=-1)  # [N, max_n]
    sampled = logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1).tolist()  # [N]
    top_values_list, top_ids_list = top_values.tolist(), top_ids.tolist()
    result: list[TokenLogprobs | None] = []
    for i, n in enumerate(num_logprobs):
        if n is None:
            result.append(None)
            continue
        result.append(TokenLogprobs(sampled[i], top_ids_list[i][:n], top_values_list[i][:n]))
    return result


def mix_seed(seed: int, k: int) -> int:
    """A 64-bit generator seed from (request seed, output position k): splitmix64."""
    z = (seed * 0x9E3779B97F4A7C15 + k + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def _flatten(
    token_ids: list[list[int]], rows: list[int] | range, device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor]:
    """(row index, token id) pairs of the listed rows, as two flat int64 tensors."""
    row_index = [i for i in rows for _ in token_ids[i]]
    tokens = [t for i in rows for t in token_ids[i]]
    return (
        torch.tensor(row_index, dtype=torch.int64, device=device),
        torch.tensor(tokens, dtype=torch.int64, device=device),
    )


def _token_counts(
    rows: torch.Tensor, tokens: torch.Tensor, num_rows: int, vocab_size: int
) -> torch.Tensor:
    """[N, V] float32 occurrence counts, built with one scatter_add."""
    counts = torch.zeros(num_rows * vocab_size, dtype=torch.float32, device=rows.device)
    if rows.numel():
        ones = torch.ones(rows.numel(), dtype=torch.float32, device=rows.device)
        counts.scatter_add_(0, rows * vocab_size + tokens, ones)
    return counts.view(num_rows, vocab_size)

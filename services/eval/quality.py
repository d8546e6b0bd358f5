"""How close a quantized (or lower-precision) model stays to the full one, in process.

* Perplexity on English prose that ships with Python itself: `pydoc_data.topics`, the
  ~460 kB of language-reference text behind `help()`. The text is tokenized once and cut
  into fixed windows; each window is one prefill of the worker's own model (loaded as a
  worker loads it, `StageRunner.from_config`), scored on every position after the first.
* Greedy agreement: a fixed prompt set decoded greedily through the worker's step path
  (`StageRunner.execute`), compared token by token with a reference model's output.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from services.common.sampling import SamplingParams
from services.common.step import CachedRequest, NewRequest, StepPlan
from services.kernels.metadata import AttentionMetadata
from services.worker.runner import StageRunner

PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Photosynthesis is the process by which",
    "Once upon a time, in a small village by the sea,",
    "The three primary colors are",
    "To install a Python package, run",
    "Water boils at a temperature of",
    "The most important rule of writing clear code is",
)
"""The fixed prompt set of the greedy agreement check."""


@dataclass(slots=True, frozen=True)
class Perplexity:
    """exp(mean negative log-likelihood) over `num_tokens` scored tokens."""

    value: float
    num_tokens: int
    seconds: float


@dataclass(slots=True, frozen=True)
class Agreement:
    """Greedy tokens of a model against a reference's, over the prompt set."""

    num_identical: int
    """Prompts whose every generated token equals the reference's."""
    num_prompts: int
    prefix_fraction: float
    """Mean over prompts of (tokens before the first difference) / tokens generated."""
    token_fraction: float
    """Generated tokens equal to the reference's at the same position, over all tokens."""


def corpus_text() -> str:
    """The text of every `help()` topic, in sorted order."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[name] for name in sorted(topics))


def make_windows(token_ids: list[int], window: int, num_windows: int) -> list[list[int]]:
    """`num_windows` consecutive, non-overlapping windows of `window` tokens."""
    windows = [token_ids[i : i + window] for i in range(0, len(token_ids), window)]
    return [w for w in windows if len(w) == window][:num_windows]


def _prefill_metadata(num_seqs: int, window: int, block_size: int) -> AttentionMetadata:
    """A batch of `num_seqs` whole prompts of `window` tokens, blocks 0.. handed out in order."""
    blocks_per_seq = -(-window // block_size)
    block_tables = torch.arange(num_seqs * blocks_per_seq).view(num_seqs, blocks_per_seq)
    positions = torch.arange(window).repeat(num_seqs)  # [T]
    seq_of_row = torch.arange(num_seqs).repeat_interleave(window)
    slot_mapping = block_tables[seq_of_row, positions // block_size] * block_size
    return AttentionMetadata(
        positions=positions,
        slot_mapping=slot_mapping + positions % block_size,
        query_start_loc=torch.arange(0, (num_seqs + 1) * window, window, dtype=torch.int32),
        seq_lens=torch.full((num_seqs,), window, dtype=torch.int32),
        block_tables=block_tables.to(torch.int32),
        max_query_len=window,
        max_seq_len=window,
    )


@torch.inference_mode()
def perplexity(runner: StageRunner, windows: list[list[int]], batch_size: int = 4) -> Perplexity:
    """Perplexity of a single-stage runner's model over `windows` (equal lengths)."""
    model, device = runner.model, runner.device
    window, block_size = len(windows[0]), runner.kv_cache.block_size
    nll, count, start = 0.0, 0, time.perf_counter()
    for first in range(0, len(windows), batch_size):
        batch = windows[first : first + batch_size]
        meta = _prefill_metadata(len(batch), window, block_size)
        meta = AttentionMetadata(**{f: _to(getattr(meta, f), device) for f in meta.__slots__})
        ids = torch.tensor(batch, device=device)  # [B, W]
        hidden = model(meta, runner.kv_cache.layers, input_ids=ids.flatten())  # [B*W, hidden]
        for row in range(len(batch)):  # one window's logits at a time: [W, V] float32
            logits = model.compute_logits(hidden[row * window : (row + 1) * window - 1])
            nll += float(torch.nn.functional.cross_entropy(logits, ids[row, 1:], reduction="sum"))
            count += window - 1
    return Perplexity(math.exp(nll / count), count, time.perf_counter() - start)


def _to(value, device):
    return value.to(device) if isinstance(value, torch.Tensor) else value


@torch.inference_mode()
def greedy(runner: StageRunner, prompts: list[list[int]], num_tokens: int) -> list[list[int]]:
    """Greedy continuations of `prompts` (all in one batch), through `runner.execute`."""
    block_size = runner.kv_cache.block_size
    new = []
    for i, prompt in enumerate(prompts):
        num_blocks = -(-(len(prompt) + num_tokens) // block_size)
        blocks = list(range(i * num_blocks, (i + 1) * num_blocks))  # prompts are short
        sampling = SamplingParams(max_tokens=num_tokens, temperature=0.0)
        new.append(NewRequest(f"p{i}", list(prompt), len(prompt), sampling, blocks, 0, len(prompt)))
    outputs: list[list[int]] = [[] for _ in prompts]
    plan = StepPlan(0, new_requests=new)
    for step in range(num_tokens):
        result = runner.execute(plan)
        for request_id, token_id in zip(result.request_ids, result.token_ids, strict=True):
            outputs[int(request_id[1:])].append(token_id)
        cached = [CachedRequest(r.request_id, 1) for r in new]
        plan = StepPlan(step + 1, cached_requests=cached)
    runner.execute(StepPlan(num_tokens, finished_request_ids=[r.request_id for r in new]))
    return outputs


def agreement(outputs: list[list[int]], reference: list[list[int]]) -> Agreement:
    """Compare greedy outputs with a reference's, prompt by prompt."""
    prefixes, same_tokens, total = [], 0, 0
    for ours, theirs in zip(outputs, reference, strict=True):
        prefix = next(
            (i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b), len(ours)
        )
        prefixes.append(prefix / max(len(ours), 1))
        same_tokens += sum(a == b for a, b in zip(ours, theirs, strict=True))
        total += len(ours)
    return Agreement(
        sum(p == 1.0 for p in prefixes),
        len(outputs),
        sum(prefixes) / len(prefixes),
        same_tokens / max(total, 1),
    )

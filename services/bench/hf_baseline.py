"""The peer baseline: Hugging Face transformers `generate()` with static batching.

Every prompt in one batch (left-padded), greedy, exactly `output_len` new tokens (EOS
ignored), on `threads` intra-op threads. TPOT is estimated as (total - prefill) /
(output_len - 1), the prefill timed by a separate 1-token generate of the same batch.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from services.bench.datasets import BenchRequest

logger = logging.getLogger(__name__)


def _batch(requests: list[BenchRequest], pad_id: int):
    """(input_ids, attention_mask), left-padded to the longest prompt."""
    import torch

    width = max(len(r.prompt_ids) for r in requests)
    ids = torch.full((len(requests), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(requests), width), dtype=torch.long)
    for row, r in enumerate(requests):
        ids[row, width - len(r.prompt_ids) :] = torch.tensor(r.prompt_ids)
        mask[row, width - len(r.prompt_ids) :] = 1
    return ids, mask


def hf_static_batching(
    model_dir: str | Path, requests: list[BenchRequest], threads: int = 2
) -> dict:
    """Runs the batch once after a short warm-up; returns throughputs and latencies."""
    import torch
    import transformers

    torch.set_num_threads(threads)
    transformers.utils.logging.disable_progress_bar()
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    pad_id = model.config.pad_token_id or 0
    input_ids, mask = _batch(requests, pad_id)
    output_len = max(r.output_len for r in requests)

    def generate(num_new: int, rows: int | None = None) -> float:
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(
                input_ids[:rows],
                attention_mask=mask[:rows],
                do_sample=False,
                max_new_tokens=num_new,
                min_new_tokens=num_new,
                pad_token_id=pad_id,
            )
        return time.perf_counter() - start

    generate(2, rows=2)  # warm-up
    prefill_s = generate(1)
    total_s = generate(output_len)
    num_out = len(requests) * output_len
    num_in = sum(len(r.prompt_ids) for r in requests)
    return {
        "duration_s": total_s,
        "completed": len(requests),
        "failed": 0,
        "request_throughput": len(requests) / total_s,
        "output_throughput": num_out / total_s,
        "total_token_throughput": (num_in + num_out) / total_s,
        "mean_ttft_ms": prefill_s * 1000,
        "mean_tpot_ms": (total_s - prefill_s) / max(1, output_len - 1) * 1000,
        "mean_e2el_ms": total_s * 1000,
        "threads": threads,
    }

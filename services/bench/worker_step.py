"""Time one stage's forward (all layers of SmolLM2-135M, fp32, CPU) beside transformers'.

    python -m services.bench.worker_step [--model DIR] [--threads 2] [--iters 10]

Decode: batch B at context 256 (every sequence has 255 cached tokens and decodes one).
Ours runs the paged cache through the runner's own input building (`step` column) and
the bare forward + logits of the sampled rows (`forward`). Transformers runs
LlamaForCausalLM with its DynamicCache holding the same 255 tokens (cropped back after
each call) and `logits_to_keep=1`. Prefill: one 512-token prompt, empty cache on both sides.
Times are medians in milliseconds.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from services.common.sampling import SamplingParams
from services.common.step import CachedRequest, NewRequest, StepPlan
from services.worker.kv_cache import KVCache, KVCacheSpec
from services.worker.model.config import ModelConfig
from services.worker.model.loader import load_stage_model
from services.worker.model.stages import stage_spec
from services.worker.runner import ScheduledBatch, StageRunner

CONTEXT = 256
BLOCK_SIZE = 16


def interleaved_ms(cases: list[tuple], iters: int) -> list[float]:
    """Median ms of each (fn, after) case over `iters` rounds after 2 warm-ups. Cases are
    timed in turn within each round, so a shared machine's load falls on all alike;
    `after()` (untimed) restores the state for the next call."""
    times: list[list[float]] = [[] for _ in cases]
    for i in range(iters + 2):
        for case_times, (fn, after) in zip(times, cases, strict=True):
            start = time.perf_counter()
            fn()
            if i >= 2:
                case_times.append((time.perf_counter() - start) * 1000)
            if after is not None:
                after()
    return [statistics.median(t) for t in times]


def make_runner(
    model_dir: Path,
    config: ModelConfig,
    num_blocks: int,
    linear_backend: str,
    attention_backend: str,
) -> StageRunner:
    stage = stage_spec(config.num_hidden_layers, 1, 0)
    model = load_stage_model(model_dir, stage, "float32", attention_backend)
    if linear_backend == "onednn":
        model.use_onednn()
    spec = KVCacheSpec(
        stage.num_layers, config.num_key_value_heads, config.head_dim, BLOCK_SIZE, torch.float32
    )
    return StageRunner(model, KVCache(spec, num_blocks))


def ours_decode(runner: StageRunner, batch: int) -> list[tuple]:
    """Cases (step, forward) for `batch` sequences decoding at context CONTEXT."""
    blocks_per_seq = -(-CONTEXT // BLOCK_SIZE)
    runner.requests.clear()
    new = [
        NewRequest(
            f"r{i}",
            [5] * CONTEXT,
            CONTEXT - 1,
            SamplingParams(),
            list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)),
            CONTEXT - 1,
            1,
        )
        for i in range(batch)
    ]
    runner.execute(StepPlan(0, new_requests=new))
    plan = StepPlan(1, cached_requests=[CachedRequest(f"r{i}", 1, [], [5]) for i in range(batch)])

    def rewind() -> None:  # back to CONTEXT - 1 computed tokens
        for state in runner.requests.values():
            state.num_computed_tokens = CONTEXT - 1

    rewind()
    states = list(runner.requests.values())
    meta, input_ids = runner._prepare(ScheduledBatch(states, [1] * batch, [[]] * batch))

    @torch.inference_mode()
    def forward() -> None:
        hidden = runner.model(meta, runner.kv_cache.layers, input_ids=input_ids)
        runner.model.compute_logits(hidden)

    return [(lambda: runner.execute(plan), rewind), (forward, None)]


def ours_prefill(runner: StageRunner, length: int) -> tuple:
    blocks = list(range(-(-length // BLOCK_SIZE)))
    new = NewRequest("p", [7] * length, length, SamplingParams(), blocks, 0, length)
    return (lambda: runner.execute(StepPlan(0, new_requests=[new])), runner.requests.clear)


def hf_decode(model, config: ModelConfig, batch: int) -> tuple:
    from transformers import DynamicCache

    cache = DynamicCache()
    shape = (batch, config.num_key_value_heads, CONTEXT - 1, config.head_dim)
    for layer in range(config.num_hidden_layers):
        cache.update(torch.randn(shape), torch.randn(shape), layer)
    input_ids = torch.full((batch, 1), 5)
    positions = torch.full((batch, 1), CONTEXT - 1)

    @torch.inference_mode()
    def forward() -> None:
        model(input_ids, cache=cache, position_ids=positions, logits_to_keep=1)

    return (forward, lambda: cache.crop(-1))


def hf_prefill(model, length: int) -> tuple:
    from transformers import DynamicCache

    input_ids = torch.full((1, length), 7)

    @torch.inference_mode()
    def forward() -> None:
        model(input_ids, cache=DynamicCache(), logits_to_keep=1)

    return (forward, None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None, help="HF model dir (default: fetch)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--prefill", type=int, default=512)
    parser.add_argument(
        "--linear-backend",
        choices=["onednn", "torch"],
        default="onednn",
        help="our matmuls (default: onednn, as the worker uses on CPU)",
    )
    parser.add_argument(
        "--attention-backend",
        choices=["cpu", "torch"],
        default="cpu",
        help="our attention (default: cpu, as the worker uses on CPU)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.model is None:
        from services.models.fetch import fetch_model

        args.model = fetch_model("smollm2-135m")
    import transformers

    config = ModelConfig.from_dir(args.model)
    hf = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    num_blocks = max(args.batches) * (CONTEXT // BLOCK_SIZE + 1) + 64
    runner = make_runner(
        args.model, config, num_blocks, args.linear_backend, args.attention_backend
    )

    print(
        f"SmolLM2-135M fp32, {args.threads} threads, {args.linear_backend} matmuls, "
        f"{args.attention_backend} attention, median of {args.iters}, ms"
    )
    print(f"{'case':<22}{'ours step':>10}{'ours fwd':>10}{'HF fwd':>10}{'HF/ours step':>14}")
    for batch in args.batches:
        step, fwd, ref = interleaved_ms(
            [*ours_decode(runner, batch), hf_decode(hf, config, batch)], args.iters
        )
        name = f"decode B={batch} ctx={CONTEXT}"
        print(f"{name:<22}{step:>10.1f}{fwd:>10.1f}{ref:>10.1f}{ref / step:>14.2f}")
    runner.requests.clear()
    iters = max(2, args.iters // 3)
    step, ref = interleaved_ms(
        [ours_prefill(runner, args.prefill), hf_prefill(hf, args.prefill)], iters
    )
    name = f"prefill {args.prefill}"
    print(f"{name:<22}{step:>10.1f}{'':>10}{ref:>10.1f}{ref / step:>14.2f}")


if __name__ == "__main__":
    main()

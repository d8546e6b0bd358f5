"""A speculative verify step against a decode step, in process, in one run.

    python -m services.bench.spec_step [--model DIR] [--threads 1] [--batch 16]
        [--context 192] [--k 4] [--rounds 10]

Loads the worker's own `StageRunner.from_config` (fp32, one stage holding every layer and
the logits, the C++ CPU kernels on, as a CPU worker runs) and times `StageRunner.execute`
of three steps of `--batch` greedy requests at context `--context`, round after round so
that the outside load of a shared machine falls on all alike:

* `decode`: one position per request (a plain decode step);
* `verify`: the decode position and `--k` proposed tokens, k + 1 positions per request,
  their attention on the C++ short-chunk kernel (attention/cpu_backend.py);
* `verify-sdpa`: the same, attention on the torch path it replaced (padded SDPA over a
  dense copy of each context).

Prints the median process-CPU ms of each step, split into attention, logits (final norm
and lm_head), the rest of sampling (argmax, acceptance) and the rest (matmuls, norms,
RoPE: the layers' other work), and the ratios to the decode step. CPU time, not wall:
the machine is shared (docs/speculative-decoding.md, "Where a verify step's time goes").
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from pathlib import Path

from services.common.sampling import SamplingParams
from services.common.step import CachedRequest, NewRequest, StepPlan
from services.worker.attention import cpu_backend, torch_backend
from services.worker.config import WorkerConfig
from services.worker.runner import StageRunner

PARTS = ("attention", "logits", "sampling", "other")


class _Clock:
    """Process-CPU seconds spent inside the wrapped functions, per part."""

    def __init__(self) -> None:
        self.spent = dict.fromkeys(PARTS, 0.0)

    def wrap(self, part: str, fn):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            start = time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.spent[part] += time.process_time() - start

        return timed


def _sdpa_attend(q, k_cache, v_cache, meta, scale):
    """The CPU backend before the short-chunk kernel: decode rows on C++, chunks on SDPA."""
    return torch_backend.attend_cached(
        q, k_cache, v_cache, meta, scale, decode=cpu_backend.decode_attention
    )


def _setup(runner: StageRunner, batch: int, context: int, k: int) -> dict[str, StepPlan]:
    """Prefill `batch` requests to `context` - 1 computed tokens; the plans of each case."""
    block_size = runner.kv_cache.block_size
    blocks = -(-(context + k + 1) // block_size)
    greedy = SamplingParams(max_tokens=1 << 20, temperature=0.0)
    new = [
        NewRequest(
            f"r{i}",
            [100 + i + j % 7 for j in range(context)],
            context - 1,
            greedy,
            list(range(i * blocks, (i + 1) * blocks)),
            context - 1,
            1,
        )
        for i in range(batch)
    ]
    runner.execute(StepPlan(0, new_requests=new))
    ids = [f"r{i}" for i in range(batch)]
    proposal = list(range(6, 6 + k))
    verify = StepPlan(1, cached_requests=[CachedRequest(r, 1, [], [5], proposal) for r in ids])
    return {
        "decode": StepPlan(1, cached_requests=[CachedRequest(r, 1, [], [5]) for r in ids]),
        "verify": verify,
        "verify-sdpa": verify,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None, help="HF model dir (default: fetch)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--context", type=int, default=192)
    parser.add_argument("--k", type=int, default=4, help="proposed tokens per request")
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    if args.model is None:
        from services.models.fetch import fetch_model

        args.model = fetch_model("smollm2-135m", progress=False)
    config = WorkerConfig(
        str(args.model),
        dtype="float32",
        num_threads=args.threads,
        max_model_len=args.context + args.k + 16,
        kv_cache_memory="512MiB",
    )
    runner = StageRunner.from_config(config)
    model = runner.model
    plans = _setup(runner, args.batch, args.context, args.k)
    clock = _Clock()
    attend = {
        "decode": clock.wrap("attention", cpu_backend.attend_cached),
        "verify": clock.wrap("attention", cpu_backend.attend_cached),
        "verify-sdpa": clock.wrap("attention", _sdpa_attend),
    }
    model.compute_logits = clock.wrap("logits", model.compute_logits)
    runner._sample = clock.wrap("sampling", runner._sample)  # its logits counted apart

    def rewind() -> None:  # back to context - 1 computed tokens, nothing emitted
        for state in runner.requests.values():
            state.num_computed_tokens = args.context - 1
            del state.token_ids[args.context :]

    samples: dict[str, list[dict[str, float]]] = {case: [] for case in plans}
    for round_index in range(args.rounds + 2):  # 2 warm-up rounds
        for case, plan in plans.items():
            for layer in model.layers:
                layer.self_attn.attend = attend[case]
            rewind()
            clock.spent = dict.fromkeys(PARTS, 0.0)
            start = time.process_time()
            runner.execute(plan)
            total = time.process_time() - start
            if round_index >= 2:
                spent = dict(clock.spent)
                spent["sampling"] -= spent["logits"]
                spent["other"] = total - spent["attention"] - spent["logits"] - spent["sampling"]
                samples[case].append({"total": total, **spent})
    print(
        f"{args.batch} requests at context {args.context}, k = {args.k}, {args.threads} "
        f"thread(s): median process-CPU ms per step over {args.rounds} interleaved rounds"
    )
    print(f"{'step':<13}{'total':>8}" + "".join(f"{p:>11}" for p in PARTS) + f"{'/ decode':>10}")
    medians = {
        case: {key: statistics.median(s[key] for s in rows) * 1e3 for key in rows[0]}
        for case, rows in samples.items()
    }
    for case, med in medians.items():
        ratio = med["total"] / medians["decode"]["total"]
        parts = "".join(f"{med[p]:>11.1f}" for p in PARTS)
        print(f"{case:<13}{med['total']:>8.1f}{parts}{ratio:>10.2f}")


if __name__ == "__main__":
    main()

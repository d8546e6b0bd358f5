"""One request's decode step in process, with and without the C++ CPU kernels, in one run.

    python -m services.bench.decode_step [--model DIR] [--threads 2] [--context 128]
        [--batch 1] [--rounds 15] [--formats fp32 bf16 int8]

For each weight format (fp32; bf16; int8 weights with bf16 activations) it loads the
worker's own `StageRunner.from_config` (one stage, all layers, `--linear-backend auto`)
and times `StageRunner.execute` of a decode step of `--batch` requests at context
`--context` (prepare + forward + logits + sampling), in three variants:

* `kernels`: as a worker runs now: matmuls of 1-4 rows on `cpu_ops.small_linear`, each
  layer's elementwise work fused (model/cpu_ops.py), a step of 1-4 rows through all the
  layers in one C++ call (`model/llama.py` `decode_stack`);
* `loop`: the same kernels called from Python layer by layer (`model/llama.py`
  `direct_layer`), as before a decode step of 1-4 rows took its layers in one C++ call
  (`decode_stack`);
* `eager`: the path before them (oneDNN for every matmul, torch's int8 kernel, elementwise
  ops in eager PyTorch; `--linear-backend onednn` gives it in a worker). On a CPU with
  AMX-BF16 a bf16 stage holds the AMX copy instead of oneDNN's packed one, so there its
  eager matmuls run torch's matmul over the plain weight, not oneDNN's packed GEMM.

Every format x variant takes one step in turn, round after round, so the outside load of
a shared machine falls on all alike. Prints the median wall and process-CPU ms per step
and the ratios between them.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from services.common.sampling import SamplingParams
from services.common.step import CachedRequest, NewRequest, StepPlan
from services.worker.config import WorkerConfig
from services.worker.model.packed_linear import PackedLinear
from services.worker.model.quant import QuantLinear
from services.worker.runner import StageRunner

FORMATS = {  # key -> (dtype, quantization)
    "fp32": ("float32", None),
    "bf16": ("bfloat16", None),
    "int8": ("bfloat16", "int8"),
}


def set_cpu_kernels(runner: StageRunner, enabled: bool, attend, stack: bool = True) -> None:
    """Turn the C++ CPU kernels of a runner built with them on or off (`stack`: the layers
    of a decode step in one C++ call)."""
    model = runner.model
    model.stack_decode = stack
    for module in model.modules():
        if isinstance(module, PackedLinear):
            module.small_batch = enabled and module.weight is not None
        elif isinstance(module, QuantLinear):
            module.small_batch = enabled
    for layer in model.layers:
        layer.fused = enabled
        layer.self_attn.attend = attend if enabled else None
    model.norm.fused = model.fused = enabled


def decode_case(runner: StageRunner, batch: int, context: int):
    """A step function running one decode step of `batch` requests at `context` tokens;
    it rewinds the requests after each step so every step sees the same context."""
    block_size = runner.kv_cache.block_size
    blocks = -(-context // block_size)
    new = [
        NewRequest(
            f"r{i}",
            [100 + i] * context,
            context - 1,
            SamplingParams(max_tokens=1 << 20, temperature=0.0),
            list(range(i * blocks, (i + 1) * blocks)),
            context - 1,
            1,
        )
        for i in range(batch)
    ]
    runner.execute(StepPlan(0, new_requests=new))
    plan = StepPlan(1, cached_requests=[CachedRequest(f"r{i}", 1, [], [5]) for i in range(batch)])

    def rewind() -> None:  # back to context - 1 computed tokens
        for state in runner.requests.values():
            state.num_computed_tokens = context - 1

    def step() -> None:
        runner.execute(plan)
        rewind()

    rewind()
    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None, help="HF model dir (default: fetch)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--formats", nargs="+", choices=list(FORMATS), default=list(FORMATS))
    args = parser.parse_args()
    if args.model is None:
        from services.models.fetch import fetch_model

        args.model = fetch_model("smollm2-135m")
    cases = {}
    for key in args.formats:
        dtype, quantization = FORMATS[key]
        config = WorkerConfig(
            str(args.model),
            dtype=dtype,
            quantization=quantization,
            num_threads=args.threads,
            max_model_len=args.context + 16,
            # 64 KiB a token covers SmolLM2's fp32 KV (46 KiB) for every request
            kv_cache_memory=f"{max(256, args.batch * (args.context + 16) // 16)}MiB",
        )
        runner = StageRunner.from_config(config)
        attend = runner.model.layers[0].self_attn.attend
        step = decode_case(runner, args.batch, args.context)
        for variant in ("kernels", "loop", "eager"):
            cases[(key, variant)] = (runner, attend, step)
    wall: dict[tuple, list[float]] = {case: [] for case in cases}
    cpu: dict[tuple, list[float]] = {case: [] for case in cases}
    for round_index in range(args.rounds + 2):  # 2 warm-up rounds
        for case, (runner, attend, step) in cases.items():
            set_cpu_kernels(runner, case[1] != "eager", attend, stack=case[1] == "kernels")
            start, start_cpu = time.perf_counter(), time.process_time()
            step()
            if round_index >= 2:
                wall[case].append((time.perf_counter() - start) * 1e3)
                cpu[case].append((time.process_time() - start_cpu) * 1e3)
    print(
        f"decode step, {args.batch} request(s) at context {args.context}, {args.threads} "
        f"threads, median of {args.rounds} interleaved rounds (ms)"
    )
    print(f"{'format':<8}{'variant':<10}{'wall':>8}{'cpu':>8}")
    med = {case: (statistics.median(wall[case]), statistics.median(cpu[case])) for case in cases}
    for (key, variant), (w, c) in med.items():
        print(f"{key:<8}{variant:<10}{w:>8.2f}{c:>8.2f}")
    print("ratios (wall, cpu)")
    for key in args.formats:
        (kw, kc), (ew, ec) = med[(key, "kernels")], med[(key, "eager")]
        (lw, lc) = med[(key, "loop")]
        print(f"  {key} kernels / eager              {kw / ew:6.2f} {kc / ec:6.2f}")
        print(f"  {key} kernels / loop               {kw / lw:6.2f} {kc / lc:6.2f}")
    if "int8" in args.formats and "bf16" in args.formats:
        for variant in ("kernels", "loop", "eager"):
            (iw, ic), (bw, bc) = med[("int8", variant)], med[("bf16", variant)]
            print(f"  int8 / bf16, {variant:<8}            {iw / bw:6.2f} {ic / bc:6.2f}")
    if "fp32" in args.formats and "int8" in args.formats:
        (iw, ic), (fw, fc) = med[("int8", "kernels")], med[("fp32", "kernels")]
        print(f"  int8 / fp32, kernels            {iw / fw:6.2f} {ic / fc:6.2f}")


if __name__ == "__main__":
    main()

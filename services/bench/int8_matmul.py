"""The int8 weight-only matmul against bf16, one projection, by number of rows, in one run.

    python -m services.bench.int8_matmul [--shape 3072x576] [--rows 1 4 8 16 64 256]
        [--threads 2] [--rounds 30]

For SmolLM2's gate/up projection (576 -> 3072 by default; `--shape NxK`) and each number of
rows it times, taking turns call by call (each round starting with another) so that the outside load falls on all
alike:

* `int8 <isa>`: `QuantLinear` int8 on `cpu_ops.small_linear` with each instruction set this
  CPU runs its exact integer dot with (`amx`: AMX tiles from 4 rows on, AVX512-VNNI below;
  `avx512_vnni`; `avx2`; all give the same bits);
* `torch int8`: torch's `_weight_int8pack_mm` (bf16 activations);
* `bf16`: `F.linear` in bf16 (oneDNN, AMX-BF16 where the CPU has it).

Prints the median µs per call and each one's ratio to bf16.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from services.worker.model import cpu_ops
from services.worker.model.quant import QuantLinear


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="3072x576", help="out x in features")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 64, 256])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    out_features, in_features = (int(v) for v in args.shape.split("x"))
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(out_features, in_features, generator=gen) * 0.05
    weight_bf16 = weight.bfloat16()
    kernels = cpu_ops.load_kernels()
    isas = [isa for isa in kernels.int8_isas() if isa != "scalar"]

    def with_isa(isa):
        layer = QuantLinear("int8", weight, None)  # a copy per case: the weights come from
        # memory in every call (the other cases' copies evicted them), as in a decode step

        def call(x):
            kernels.use_int8_isa(isa)
            return layer(x)

        return call

    cases = {f"int8 {isa}": with_isa(isa) for isa in isas}
    torch_layer = QuantLinear("int8", weight, None)
    cases["torch int8"] = lambda x: torch.ops.aten._weight_int8pack_mm(
        x, torch_layer.qweight, torch_layer.scale_bf16
    )
    cases["bf16"] = lambda x: F.linear(x, weight_bf16)
    print(f"{out_features}x{in_features}, {args.threads} threads, median us per call")
    print("rows  " + "".join(f"{name:>18}" for name in cases))
    try:
        for rows in args.rows:
            x = torch.randn(rows, in_features, generator=gen).bfloat16()
            times: dict[str, list[float]] = {name: [] for name in cases}
            names = list(cases)
            for round_ in range(args.rounds + 3):  # each round in another order: no case
                for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
                    call = cases[name]  # always runs first, on a cold cache
                    start = time.perf_counter()
                    call(x)
                    times[name].append(time.perf_counter() - start)
            medians = {name: statistics.median(t[3:]) * 1e6 for name, t in times.items()}
            cells = "".join(f"{us:>9.0f} ({us / medians['bf16']:4.2f}x)" for us in medians.values())
            print(f"{rows:>4}  {cells}", flush=True)
    finally:
        kernels.use_int8_isa(kernels.int8_isas()[0])


if __name__ == "__main__":
    main()

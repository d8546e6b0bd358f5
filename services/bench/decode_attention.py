"""The decode attention of one step, alone: the worker's C++ kernel (model/csrc/cpu_ops.cpp)
over every layer's own paged cache, and optionally other builds of it, alternating in one
process.

    python -m services.bench.decode_attention [--batch 64] [--context 192] [--rounds 11]
        [--against OLD.cpp ...]

SmolLM2-135M's shapes (30 layers, 9 query heads, 3 KV heads, head_dim 64, blocks of 16),
float32 and bfloat16 caches, each sequence's blocks in random order (as a long-running
cache hands them out) and in one contiguous run. `--against` builds each given copy of
cpu_ops.cpp (say `git show HEAD~1:services/worker/model/csrc/cpu_ops.cpp > old.cpp`) with the
same flags as the worker's and times it in turn with this checkout's kernel, round after
round, so the load of a shared machine falls on all alike. Prints the median ms per step,
the KV bytes read per second, each build's time over this checkout's, and the largest
difference of its output (the last layer's) from this checkout's.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from services.worker.cpp_build import build_extension
from services.worker.model import cpu_ops

LAYERS, HEADS, KV_HEADS, HEAD_DIM, BLOCK = 30, 9, 3, 64, 16


def kernels(sources: list[Path]) -> dict[str, object]:
    """This checkout's kernel, then one build per other source, by name."""
    arch, flags = cpu_ops._arch()
    built = {"this checkout": cpu_ops.load_kernels()}
    for index, source in enumerate(sources):
        name = f"conveyor_attention_bench_{index}_{arch}"
        built[str(source)] = build_extension(name, source.resolve(), flags, f"kernel {source}")
    return built


def case(dtype: torch.dtype, batch: int, context: int, random_order: bool, seed: int = 0):
    """(queries, caches per layer, block tables, lengths) of a decode step."""
    gen = torch.Generator().manual_seed(seed)
    per_seq = -(-context // BLOCK)
    num_blocks = batch * per_seq + 8
    order = torch.randperm(num_blocks, generator=gen) if random_order else torch.arange(num_blocks)
    tables = order[: batch * per_seq].to(torch.int32).view(batch, per_seq).contiguous()
    shape = (num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
    caches = [
        (torch.randn(shape, generator=gen).to(dtype), torch.randn(shape, generator=gen).to(dtype))
        for _ in range(LAYERS)
    ]
    queries = [torch.randn(batch, HEADS, HEAD_DIM, generator=gen).to(dtype) for _ in range(LAYERS)]
    return queries, caches, tables, torch.full((batch,), context, dtype=torch.int32)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=192)
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--against", type=Path, nargs="*", default=[])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    built = kernels(args.against)
    scale = HEAD_DIM**-0.5
    print(
        f"decode attention of {LAYERS} layers, {args.batch} requests at context {args.context}, "
        f"{args.threads} threads, median of {args.rounds} alternating rounds"
    )
    for dtype in (torch.float32, torch.bfloat16):
        for random_order in (True, False):
            queries, caches, tables, lens = case(dtype, args.batch, args.context, random_order)
            kv_bytes = sum(k.element_size() for k, _ in caches) * 2 * args.batch * args.context
            kv_bytes *= KV_HEADS * HEAD_DIM
            outs: dict[str, torch.Tensor] = {}
            times: dict[str, list[float]] = {name: [] for name in built}
            for _ in range(args.rounds + 1):  # the first round warms up
                for name, module in built.items():
                    start = time.perf_counter()
                    for q, (k, v) in zip(queries, caches, strict=True):
                        outs[name] = module.decode_attention(q, k, v, tables, lens, scale)
                    times[name].append((time.perf_counter() - start) * 1e3)
            base = statistics.median(times["this checkout"][1:])
            for name, values in times.items():
                ms = statistics.median(values[1:])
                diff = (outs[name].float() - outs["this checkout"].float()).abs().max().item()
                print(
                    f"  {str(dtype).removeprefix('torch.'):<9} "
                    f"{'random' if random_order else 'contiguous':<11}{ms:8.1f} ms "
                    f"{kv_bytes / ms / 1e6:6.1f} GB/s  x{ms / base:5.2f}  max diff {diff:.1e}  "
                    f"{name}"
                )


if __name__ == "__main__":
    main()

"""Measure this machine's peaks for a CPU profile of the simulated device.

    python -m services.worker.sim.measure [--threads 1 2] [--write FILE]

For each thread count: matmul GF/s (float32, through oneDNN with packed weights as the CPU
worker runs them, else `F.linear`; the best of a few shapes), memory read GB/s (summing a
tensor far larger than the caches), and the gloo link between two ranks on loopback (the
transport of CPU pipelines: latency of an 8-byte message, bandwidth of 4 MiB); each the
fastest of several tries, the least disturbed on a shared machine. `--write`
saves a profile file with these peaks and neutral efficiencies (1.0) and no overheads;
`python -m services.worker.sim.calibrate` fits those to real steps.
"""

from __future__ import annotations

import argparse
import datetime
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from services.common.redis_server import free_port
from services.worker.sim.profiles import HardwareProfile, write_profiles

MATMUL_SHAPES = ((512, 576, 1536), (512, 1536, 576), (2048, 2048, 2048))
"""(rows, in, out): SmolLM2's MLP on a 512-token step, and one large square GEMM."""
READ_BYTES = 512 << 20
LINK_BYTES = 4 << 20


@dataclass(slots=True)
class Peaks:
    """What one thread count achieves on this machine."""

    threads: int
    matmul_flops: float
    read_bandwidth: float
    link_latency_s: float
    link_bandwidth: float

    def profile(self) -> HardwareProfile:
        """A CPU profile of these peaks, efficiencies 1.0 and no overheads (to be fitted)."""
        return HardwareProfile(
            name="cpu",
            description=f"this machine, {self.threads} thread(s) (measured)",
            device_kind="cpu",
            dtype="float32",
            peak_flops=self.matmul_flops,
            memory_bandwidth=self.read_bandwidth,
            memory_bytes=None,
            compute_efficiency=1.0,
            memory_efficiency=1.0,
            attention_compute_efficiency=1.0,
            attention_memory_efficiency=1.0,
            step_overhead_s=0.0,
            layer_overhead_s=0.0,
            seq_overhead_s=0.0,
            link_bandwidth=self.link_bandwidth,
            link_latency_s=self.link_latency_s,
            tp_bandwidth=self.link_bandwidth,
            tp_latency_s=self.link_latency_s,
            overlap=False,
            threads=self.threads,
        )


def best_s(fn, repeats: int) -> float:
    """The fastest of `repeats` timed calls (after one warm-up): the least disturbed."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


@torch.inference_mode()
def matmul_flops(repeats: int = 20) -> float:
    """Best float32 GEMM FLOP/s over MATMUL_SHAPES, on the worker's matmul path."""
    from services.worker.model.packed_linear import PackedLinear, onednn_supported

    best = 0.0
    for rows, n_in, n_out in MATMUL_SHAPES:
        x, weight = torch.randn(rows, n_in), torch.randn(n_out, n_in)
        if onednn_supported("cpu", torch.float32):
            layer = PackedLinear(weight)
        else:
            layer = torch.nn.Linear(n_in, n_out, bias=False)
            layer.weight.data = weight
        seconds = best_s(lambda x=x, layer=layer: layer(x), repeats)
        best = max(best, 2.0 * rows * n_in * n_out / seconds)
    return best


def read_bandwidth(repeats: int = 20) -> float:
    """Bytes/s of summing a READ_BYTES float32 tensor (a pure streaming read)."""
    data = torch.ones(READ_BYTES // 4)
    return READ_BYTES / best_s(data.sum, repeats)


def _link_rank(rank: int, port: int, repeats: int, results) -> None:
    """One side of a gloo ping-pong; rank 0 puts {size: [one-way seconds]} on `results`."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=60)
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=timeout)
    group = dist.ProcessGroupGloo(store, rank, 2, timeout)
    times: dict[int, list[float]] = {8: [], LINK_BYTES: []}
    for size, samples in times.items():
        buf = torch.zeros(size // 4)
        for i in range(repeats + 1):
            start = time.perf_counter()
            if rank == 0:  # half a round trip is one transfer
                group.send([buf], 1, 0).wait()
                group.recv([buf], 1, 0).wait()
                if i:
                    samples.append((time.perf_counter() - start) / 2)
            else:
                group.recv([buf], 0, 0).wait()
                group.send([buf], 0, 0).wait()
    if rank == 0:
        results.put(times)


def link(repeats: int = 50) -> tuple[float, float]:
    """(latency s, bandwidth bytes/s) of gloo send/recv between two processes on loopback,
    as between the stage workers of a CPU pipeline."""
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    port, results = free_port(), context.Queue()
    peer = context.Process(target=_link_rank, args=(1, port, repeats, results), daemon=True)
    peer.start()
    try:
        _link_rank(0, port, repeats, results)
        times = results.get(timeout=60)
    finally:
        peer.join(timeout=30)
    latency = min(times[8])  # the fastest: the least disturbed by other processes
    return latency, LINK_BYTES / max(min(times[LINK_BYTES]) - latency, 1e-9)


def measure(threads: int) -> Peaks:
    """This machine's peaks with `threads` intra-op threads."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        latency, bandwidth = link()
        return Peaks(threads, matmul_flops(), read_bandwidth(), latency, bandwidth)
    finally:
        torch.set_num_threads(previous)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--write", type=Path, default=None, metavar="FILE", help="profile file")
    args = parser.parse_args()
    peaks = [measure(n) for n in args.threads]
    print(
        f"{'threads':>7}  {'matmul GF/s':>11}  {'read GB/s':>9}  {'link us':>7}  {'link GB/s':>9}"
    )
    for p in peaks:
        print(
            f"{p.threads:>7}  {p.matmul_flops / 1e9:>11.1f}  {p.read_bandwidth / 1e9:>9.1f}  "
            f"{p.link_latency_s * 1e6:>7.1f}  {p.link_bandwidth / 1e9:>9.2f}"
        )
    if args.write:
        write_profiles(args.write, [p.profile() for p in peaks])
        print(f"wrote {args.write}")


if __name__ == "__main__":
    main()

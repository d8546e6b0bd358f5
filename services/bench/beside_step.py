"""What Python work beside a decode step costs the step: the worker's event loop shares the
process (and the GIL) with the compute thread.

    python -m services.bench.beside_step [--work-us 350 300] [--threads 2] [--context 192]
        [--rounds 12] [--in process|thread]

In a worker, each step's report goes out and the next plans come in on the event loop
thread (gRPC, protobuf, the plan's parsing): ~0.65 ms of CPU a step for one request on a
2-core AMD EPYC (from /proc, docs/performance.md). This runs one request's decode step in
process (`decode_step`'s case, fp32, the C++ kernels on) in blocks of 8 steps, alternating
blocks alone and blocks where, at each step's start, another thread (`--in thread`, as in a
worker) or process (`--in process`: the cores only, not the GIL) spends `--work-us` of
CPU: one burst per value, 1 ms apart (a report, then a plan). Prints the median step
of each and the difference.
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import threading
import time
from pathlib import Path

from services.bench.decode_step import decode_case
from services.worker.config import WorkerConfig
from services.worker.runner import StageRunner

_GAP_S = 0.001


def _busy(us: float) -> None:
    end = time.perf_counter() + us / 1e6
    while time.perf_counter() < end:
        pass


def _work(event, bursts_us: list[float]) -> None:
    while True:
        event.wait()
        event.clear()
        for n, us in enumerate(bursts_us):
            if n:
                time.sleep(_GAP_S)
            _busy(us)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None, help="HF model dir (default: fetch)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--context", type=int, default=192)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--work-us", type=float, nargs="+", default=[350.0, 300.0])
    parser.add_argument("--in", dest="where", choices=("thread", "process"), default="thread")
    args = parser.parse_args()
    if args.model is None:
        from services.models.fetch import fetch_model

        args.model = fetch_model("smollm2-135m")
    config = WorkerConfig(
        str(args.model),
        dtype="float32",
        num_threads=args.threads,
        max_model_len=args.context + 16,
        kv_cache_memory="256MiB",
    )
    step = decode_case(StageRunner.from_config(config), 1, args.context)
    if args.where == "thread":
        event = threading.Event()
        threading.Thread(target=_work, args=(event, args.work_us), daemon=True).start()
    else:
        event = multiprocessing.Event()
        multiprocessing.Process(target=_work, args=(event, args.work_us), daemon=True).start()
    settle_s = _GAP_S * len(args.work_us) + sum(args.work_us) / 1e6
    times: dict[str, list[float]] = {"alone": [], "beside": []}
    for round_index in range(args.rounds + 2):  # 2 warm-up rounds
        for mode, samples in times.items():
            for _ in range(8):
                if mode == "beside":
                    event.set()
                start = time.perf_counter()
                step()
                elapsed = (time.perf_counter() - start) * 1e3
                time.sleep(settle_s)  # the work is over before the next step either way
                if round_index >= 2:
                    samples.append(elapsed)
    alone, beside = (statistics.median(times[m]) for m in ("alone", "beside"))
    work = " + ".join(f"{us:.0f}" for us in args.work_us)
    print(
        f"one request's decode step at context {args.context}, {args.threads} threads, median "
        f"of {8 * args.rounds} steps (ms): alone {alone:.2f}, beside {work} us of Python in "
        f"another {args.where} {beside:.2f}, difference {beside - alone:+.2f}"
    )


if __name__ == "__main__":
    main()

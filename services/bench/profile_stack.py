"""Profile a serving stack under load: py-spy on the router, the scheduler and each worker.

    python -m services.bench.profile_stack [--model DIR] [--stages 2] [--scheduling async]
                                  [--num-prompts 64] [--input-len 128] [--output-len 128]

Starts `conveyor up` (as `conveyor bench --compare` does), warms it up, then runs one
`conveyor bench` workload while `py-spy record` samples every service process. Writes, per
process, a speedscope JSON and the collapsed stacks under bench/results/profile-<mode>/, and
prints the functions with the most samples (self and inclusive) for each process.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import logging
import shutil
import subprocess
import sys
from pathlib import Path

from services.bench.driver import DriverOptions
from services.bench.run import BenchTarget, Workload, build_requests, run_benchmark
from services.bench.stack import Mode, start_stack

logger = logging.getLogger(__name__)


def service_pids(launcher_pid: int) -> dict[str, int]:
    """{"router"|"scheduler"|"worker0"...: pid} of the launcher's Python children."""
    children = Path(f"/proc/{launcher_pid}/task/{launcher_pid}/children").read_text().split()
    pids = {}
    for pid in map(int, children):
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        argv = [a.decode() for a in argv if a]
        if "services.cli" not in argv:
            continue
        command = argv[argv.index("services.cli") + 1]
        if command == "worker":
            command += argv[argv.index("--stage") + 1]
        pids[command] = pid
    return pids


def top_functions(collapsed: Path, limit: int = 12) -> tuple[list, list, int]:
    """(self, inclusive) [(frame, samples)] of a py-spy raw (collapsed stacks) file."""
    own, inclusive, total = collections.Counter(), collections.Counter(), 0
    for line in collapsed.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        n = int(count)
        total += n
        own[frames[-1]] += n
        for frame in set(frames):
            inclusive[frame] += n
    return own.most_common(limit), inclusive.most_common(limit), total


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--scheduling", default="async")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--duration", type=int, default=30, help="seconds py-spy samples")
    parser.add_argument("--rate", type=int, default=100, help="py-spy samples per second")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    beside = Path(sys.executable).parent / "py-spy"
    py_spy = str(beside) if beside.exists() else shutil.which("py-spy")
    if not py_spy:
        sys.exit("py-spy not found: install the project's dev extras (pip install py-spy)")
    from services.models.fetch import fetch_model

    model = args.model or fetch_model("smollm2-135m")
    threads = args.threads or max(1, 2 // args.stages)
    mode = Mode(
        f"{args.scheduling}-{args.stages}stage",
        f"{args.stages} stages {args.scheduling}",
        args.stages,
        args.scheduling,
        threads,
    )
    out_dir = Path("bench/results") / f"profile-{mode.key}"
    out_dir.mkdir(parents=True, exist_ok=True)
    stack = start_stack(model, mode, out_dir)
    try:
        pids = service_pids(stack.proc.pid)
        workload = Workload(
            num_prompts=args.num_prompts, input_len=args.input_len, output_len=args.output_len
        )
        requests = asyncio.run(build_requests(stack.router, workload))
        quiet = BenchTarget(stack.router, None, DriverOptions(progress=False))
        asyncio.run(run_benchmark(quiet, requests[:4]))  # warm-up
        spies = {}
        for name, pid in pids.items():
            for fmt, suffix in (("raw", "txt"), ("speedscope", "speedscope.json")):
                spies[name, fmt] = subprocess.Popen(
                    [
                        py_spy,
                        "record",
                        "--pid",
                        str(pid),
                        "--rate",
                        str(args.rate),
                        "--duration",
                        str(args.duration),
                        "--format",
                        fmt,
                        "--nonblocking",
                        "--output",
                        str(out_dir / f"{name}.{suffix}"),
                    ],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
        result = asyncio.run(run_benchmark(BenchTarget(stack.router, stack.scheduler), requests))
        for spy in spies.values():
            spy.wait()
    finally:
        stack.stop()
    print(
        f"output throughput {result['output_throughput']:.1f} tok/s, "
        f"mean TPOT {result['mean_tpot_ms']:.1f} ms, bubble {result.get('bubble_fraction')}"
    )
    for name in pids:
        raw = out_dir / f"{name}.txt"
        if not raw.exists():
            print(f"\n{name}: no profile (py-spy failed?)")
            continue
        own, inclusive, total = top_functions(raw)
        print(f"\n=== {name}: {total} samples ===")
        print("  self:")
        for frame, n in own:
            print(f"    {n / total:6.1%}  {frame}")
        print("  inclusive:")
        for frame, n in inclusive:
            print(f"    {n / total:6.1%}  {frame}")
    print(f"\nspeedscope files (https://www.speedscope.app) under {out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

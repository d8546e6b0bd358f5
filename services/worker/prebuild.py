"""Build the workers' C++ CPU kernels ahead of time: `python -m services.worker.prebuild`.

A CPU worker compiles its kernels (decode attention, small-batch matmuls and fused passes)
on its first start on a machine, 30 s to a few minutes, under a lock that makes every other
worker wait. `make test` and the Dockerfile build them once here, before anything that waits
on a worker's start with a deadline. A kernel that cannot build is reported, not fatal: the
workers then fall back to torch, as they would at start. A kernel whose source file is
not installed is fatal (exit 1): the installation itself is incomplete, and an image built
from it would serve without its kernels.
"""

from __future__ import annotations

import logging
import sys
import time

from services.worker.attention import cpu_backend
from services.worker.model import cpu_ops


def main() -> int:
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    missing = [str(m.SOURCE) for m in (cpu_backend, cpu_ops) if not m.SOURCE.is_file()]
    if missing:
        print(
            f"the CPU kernels' sources are not installed: {', '.join(missing)}; this "
            "installation of Conveyor is incomplete (its package data): reinstall it",
            file=sys.stderr,
        )
        return 1
    for name, available in (
        ("decode attention", cpu_backend.available),
        ("small-batch matmul", cpu_ops.available),
    ):
        start = time.monotonic()
        state = "ready" if available() else "not built (workers fall back to torch)"
        print(f"CPU {name} kernel: {state} ({time.monotonic() - start:.1f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

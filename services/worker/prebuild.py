"""Build the workers' C++ CPU kernels ahead of time: `python -m services.worker.prebuild`.

A CPU worker compiles its kernels (decode attention, small-batch matmuls and fused passes)
on its first start on a machine, 30 s to a few minutes, under a lock that makes every other
worker wait. `make test` and the Dockerfile build them once here, before anything that waits
on a worker's start with a deadline. A kernel that cannot build is reported, not fatal: the
workers then fall back to torch, as they would at start.
"""

from __future__ import annotations

import logging
import time

from services.worker.attention import cpu_backend
from services.worker.model import cpu_ops


def main() -> int:
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
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

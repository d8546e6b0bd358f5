"""Which threads of a worker run torch's parallel work, and why it matters.

OpenMP (the runtime torch and our C++ kernels use for their parallel loops) keeps a team
of helper threads for every thread that ever ran a parallel region, for as long as that
thread lives. Once a process holds more OpenMP threads than it has cores, libgomp
"throttles": a helper waiting for the next region spins ~100 times instead of ~300,000
and then sleeps on a futex, so every parallel region (a decode step of SmolLM2 runs
~120) starts by waking its helpers from sleep.

A worker that loaded its model on asyncio's pool thread (which lives on, idle, holding
its team) and computed on its session thread (a second team) was in that state: on the
2-core machine a one-request int8 decode step at 2 threads took 26-35 ms instead of
13-18 ms in process (docs/performance.md). So a worker's one-off torch work (loading,
staging new weights) runs on a thread of its own that ends with it, taking its team
along, and the session's compute thread is the only one left with a team.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")


async def run_in_own_thread(fn: Callable[..., T], *args, name: str = "worker-load") -> T:
    """`fn(*args)` on a new thread that has ended (with any OpenMP team it made) once
    this returns; unlike `asyncio.to_thread`, whose pool threads outlive the call."""
    executor = ThreadPoolExecutor(1, thread_name_prefix=name)
    try:
        return await asyncio.get_running_loop().run_in_executor(executor, fn, *args)
    finally:
        executor.shutdown(wait=True)  # the thread is idle: it exits at once

"""Pinning a process to CPU cores (Linux), so that pipeline stages stop trading cores.

On the 2-core machine, 2 stage workers of one thread each pinned to a core apiece waited
1-1.5 ms per step for each other instead of 3-4.5 ms, and served 4 % more tokens
(`conveyor bench`, 64 x 128/128): the scheduler moved no compute thread across cores, whose
caches stay warm, and each worker's gRPC and gloo threads share its own core.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from services.common.errors import ConfigError

logger = logging.getLogger(__name__)


def parse_cpu_list(text: str) -> list[int]:
    """ "0-3,8" -> [0, 1, 2, 3, 8] (the kernel's cpulist format); ConfigError when malformed."""
    cpus: set[int] = set()
    try:
        for part in text.split(","):
            first, _, last = part.strip().partition("-")
            low, high = int(first), int(last or first)
            if low < 0 or high < low:
                raise ValueError(part)
            cpus.update(range(low, high + 1))
    except ValueError:
        raise ConfigError(
            f"cpu list {text!r} is malformed: write core ids and ranges, e.g. 0-3,8"
        ) from None
    return sorted(cpus)


def available_cpus() -> list[int]:
    """The cores this process may run on (all of os.cpu_count() where affinity is unknown)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def pin_process(cpus: list[int]) -> None:
    """Pin every thread of this process, and those it starts later, to `cpus`."""
    if not hasattr(os, "sched_setaffinity"):
        logger.warning("CPU affinity is not supported on this platform; not pinning")
        return
    allowed = set(available_cpus())
    if not set(cpus) <= allowed:
        raise ConfigError(
            f"cpu affinity {cpus} is outside the cores this process may use "
            f"({sorted(allowed)}): choose among those"
        )
    tasks = Path("/proc/self/task")
    thread_ids = [int(t.name) for t in tasks.iterdir()] if tasks.exists() else [0]
    for tid in thread_ids:
        try:
            os.sched_setaffinity(tid, cpus)
        except ProcessLookupError:  # the thread ended meanwhile
            continue
    logger.info("pinned to cores %s", cpus)


def default_threads(num_stages: int) -> int:
    """Intra-op threads per stage worker when not given: the machine's cores shared evenly."""
    return max(1, (os.cpu_count() or 1) // num_stages)


def stage_cpus(
    num_stages: int, threads: int, cpus: list[int] | None = None
) -> list[list[int]] | None:
    """Disjoint core sets for `num_stages` workers of `threads` threads each, in stage order,
    or None when they do not fit on the available cores (then nothing is pinned)."""
    cpus = cpus if cpus is not None else available_cpus()
    if num_stages < 2 or num_stages * threads > len(cpus):
        return None
    return [cpus[i * threads : (i + 1) * threads] for i in range(num_stages)]

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


def cpu_quota(
    root: Path = Path("/sys/fs/cgroup"), own: Path = Path("/proc/self/cgroup")
) -> float | None:
    """The CPUs this process's cgroup quota allows (a container's CPU limit: cgroup v2
    `cpu.max`, the smallest on the way to the root; v1 `cpu.cfs_quota_us` over
    `cpu.cfs_period_us`), or None where there is none or no cgroup to read."""
    try:
        lines = own.read_text().splitlines()
    except OSError:
        return None
    limits = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2: "0::/path"
            directory = root / path.lstrip("/")
            while True:
                limits.append(_v2_limit(directory / "cpu.max"))
                if directory == root or root not in directory.parents:
                    break
                directory = directory.parent
        elif "cpu" in controllers.split(","):  # v1: "N:cpu,cpuacct:/path"
            for mount in {root / controllers, root / "cpu"}:  # "cpu,cpuacct" or its link
                limits.append(_v1_limit(mount / path.lstrip("/")))
                limits.append(_v1_limit(mount))  # a container sees its own at the mount
    limits = [limit for limit in limits if limit is not None]
    return min(limits) if limits else None


def _v2_limit(path: Path) -> float | None:
    try:
        quota, period = path.read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        return None


def _v1_limit(directory: Path) -> float | None:
    try:
        quota = int((directory / "cpu.cfs_quota_us").read_text())
        period = int((directory / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return quota / period if quota > 0 and period > 0 else None


def cpu_budget() -> int:
    """Whole CPUs this process may use: the cores of its affinity (a container's cpuset), no
    more than its CPU quota allows (a container's CPU limit, `cpu_quota()`)."""
    return _budget(cpu_quota(), len(available_cpus()))


def default_threads(num_ranks: int) -> int:
    """Intra-op threads of a stage worker started alone (`conveyor worker`) when not given
    (`worker_threads` on this process's CPU quota and cores)."""
    return worker_threads(num_ranks, cpu_quota(), len(available_cpus()))


def worker_threads(num_ranks: int, quota: float | None, cpus: int) -> int:
    """Under a CPU quota the quota is the worker's own (a container per worker: compose with
    `cpus:`, a Helm pod with a CPU limit): all of it, in whole CPUs, at most `cpus`; OpenMP
    threads beyond it are throttled in turn, and every parallel loop waits for the last of
    them. Without one, the workers of a pipeline share the host: its `cpus` over the
    `num_ranks` workers (stages x tensor-parallel ranks). `conveyor up` divides its own
    `cpu_budget()` among the workers it starts and passes `--threads`."""
    if quota is not None:
        return _budget(quota, cpus)
    return max(1, cpus // num_ranks)


def _budget(quota: float | None, cpus: int) -> int:
    return max(1, min(cpus, int(quota)) if quota is not None else cpus)


def stage_cpus(
    num_stages: int, threads: int, cpus: list[int] | None = None
) -> list[list[int]] | None:
    """Disjoint core sets for `num_stages` workers of `threads` threads each, in stage order,
    or None when they do not fit on the available cores (then nothing is pinned)."""
    cpus = cpus if cpus is not None else available_cpus()
    if num_stages < 2 or num_stages * threads > len(cpus):
        return None
    return [cpus[i * threads : (i + 1) * threads] for i in range(num_stages)]

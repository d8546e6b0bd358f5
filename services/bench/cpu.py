"""How busy the machine was during a run, and how much of that was someone else.

On a shared machine a benchmark's numbers move with other people's load. `CpuMeter` reads
/proc (Linux) before and after a run and reports, in cores: the whole machine's busy time,
the part used by the measured processes (the stack and this process, with descendants), and
the rest (`other_cores`), which is the noise to keep in mind when reading the result.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

logger = logging.getLogger(__name__)

_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _machine_busy_ticks() -> int:
    fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    values = list(map(int, fields))
    idle = values[3] + (values[4] if len(values) > 4 else 0)  # idle + iowait
    return sum(values[:8]) - idle


def _descendants(pid: int) -> set[int]:
    found, todo = {pid}, [pid]
    while todo:
        parent = todo.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            children = (
                (task / "children").read_text().split() if (task / "children").exists() else []
            )
            for child in map(int, children):
                if child not in found:
                    found.add(child)
                    todo.append(child)
    return found


def _process_ticks(pids: set[int]) -> dict[int, int]:
    ticks = {}
    for pid in pids:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        # utime + stime, and cutime + cstime: the children it reaped (a bench client that
        # ran and exited inside the window) are ours too
        ticks[pid] = sum(int(f) for f in fields[11:15])
    return ticks


class CpuMeter:
    """Busy cores over a window: the machine's, ours (root pids and descendants), others'."""

    def __init__(self, root_pids: list[int]):
        self.root_pids = root_pids
        self._start: tuple[float, int, dict[int, int]] | None = None

    def _ours(self) -> dict[int, int]:
        pids: set[int] = set()
        for root in self.root_pids:
            pids |= _descendants(root)
        return _process_ticks(pids)

    def start(self) -> None:
        try:
            self._start = (time.monotonic(), _machine_busy_ticks(), self._ours())
        except OSError:
            self._start = None  # not Linux: no reading

    def stop(self) -> dict[str, float]:
        """{machine_busy_cores, ours_cores, other_cores} averaged over the window ({} if
        /proc could not be read)."""
        if self._start is None:
            return {}
        t0, busy0, ours0 = self._start
        try:
            busy1, ours1 = _machine_busy_ticks(), self._ours()
        except OSError:
            return {}
        seconds = max(1e-9, time.monotonic() - t0)
        ours = sum(t - ours0.get(pid, 0) for pid, t in ours1.items())
        busy = busy1 - busy0
        return {
            "machine_busy_cores": round(busy / _TICKS / seconds, 2),
            "ours_cores": round(ours / _TICKS / seconds, 2),
            "other_cores": round(max(0, busy - ours) / _TICKS / seconds, 2),
        }

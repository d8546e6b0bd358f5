"""Stopping the processes tests start."""

from __future__ import annotations

import signal
import subprocess


def stop_process(proc: subprocess.Popen, timeout_s: float = 60) -> None:
    """SIGTERM (a graceful stop: `conveyor up` stops its children and writes what it
    writes on exit), then SIGKILL if it has not exited within `timeout_s`."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()

"""Stopping the processes tests start."""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO


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


@contextmanager
def logged_process(proc: subprocess.Popen, log: IO) -> Iterator[subprocess.Popen]:
    """`proc`, whose output goes to `log`: its log's tail printed to stderr if the body
    fails; stopped (`stop_process`) and the log closed either way."""
    try:
        yield proc
    except BaseException:
        log.flush()
        print(Path(log.name).read_text()[-5000:], file=sys.stderr)
        raise
    finally:
        stop_process(proc)
        log.close()

"""Children bound to die with their parent, including programs that are not Conveyor's."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# A parent that starts `sleep 600` bound to itself and prints its pid.
_PARENT = """
import subprocess, sys, time
from services.common.process import bound_to_parent, child_env
child = subprocess.Popen(bound_to_parent(["sleep", "600"]), env=child_env())
print(child.pid, flush=True)
time.sleep(600)
"""


def _is_gone(pid: int) -> bool:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return True
    return fields[0] == "Z"  # killed, not reaped yet


def test_a_program_started_through_process_dies_with_its_parent():
    parent = subprocess.Popen(
        [sys.executable, "-c", _PARENT], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    try:
        pid = int(parent.stdout.readline())
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        deadline = time.monotonic() + 30
        while not cmdline.startswith(b"sleep") and time.monotonic() < deadline:
            time.sleep(0.05)  # the wrapper execs `sleep` in the same process
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        assert cmdline.split(b"\0")[:2] == [b"sleep", b"600"]
        parent.kill()  # no chance to clean up: only the death signal stops the child
        parent.wait()
        deadline = time.monotonic() + 10
        while not _is_gone(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _is_gone(pid), "the program outlived the parent that started it"
    finally:
        parent.kill()
        parent.wait()


def test_process_without_a_program_says_how_to_use_it():
    done = subprocess.run(
        [sys.executable, "-m", "services.common.process"], cwd=ROOT, capture_output=True, text=True
    )
    assert done.returncode == 1 and "usage: python -m services.common.process" in done.stderr

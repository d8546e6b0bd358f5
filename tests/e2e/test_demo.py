"""`make demo`'s own entry point runs end to end: a 2-stage stack answers, then stops."""

import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def test_demo_streams_an_answer_and_exits_0(smollm2_dir):
    proc = subprocess.run(
        [sys.executable, "-m", "services.demo", "--model", str(smollm2_dir), "--max-tokens", "12"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "serving on" in proc.stdout
    assert (
        "[12 tokens, finish reason: length]" in proc.stdout or "finish reason: stop" in proc.stdout
    )
    assert proc.stdout.rstrip().endswith("stack stopped")

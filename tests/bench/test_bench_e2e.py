"""`conveyor bench` against a real stack (tiny model, 2 stages, async) started by the test."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from services.bench.plot import plot_trace
from services.cli import main
from services.launcher import wait_serving
from services.models.tiny import make_tiny_model
from tests.conftest import free_port

ROOT = Path(__file__).resolve().parents[2]
RESULT_KEYS = {
    "request_throughput", "output_throughput", "total_token_throughput",
    "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms",
    "p99_tpot_ms", "mean_itl_ms", "median_itl_ms", "p99_itl_ms", "mean_e2el_ms",
    "completed", "failed", "bubble_fraction", "prefix_cache_hit_rate", "preemptions",
}  # fmt: skip


@pytest.fixture
def tiny_stack(tmp_path):
    """`conveyor up` of a tiny model, 2 stages async with --timeline; (router, scheduler,
    trace path, process), stopped at the end."""
    model = make_tiny_model(tmp_path / "tiny")
    port, scheduler_port = free_port(), free_port()
    trace = tmp_path / "trace.json"
    log = (tmp_path / "up.log").open("w")
    argv = [sys.executable, "-m", "services.cli", "up", "--model", str(model), "--stages", "2",
            "--port", str(port), "--scheduler-port", str(scheduler_port), "--threads", "1",
            "--kv-cache-memory", "32MiB", "--timeline", str(trace)]  # fmt: skip
    proc = subprocess.Popen(argv, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                            stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
    try:
        wait_serving(f"127.0.0.1:{port}", 120, proc)
        yield f"127.0.0.1:{port}", f"127.0.0.1:{scheduler_port}", trace, proc
    except BaseException:
        log.flush()
        print(Path(log.name).read_text()[-5000:], file=sys.stderr)
        raise
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        log.close()


def test_bench_against_a_real_stack_reports_every_key(tiny_stack, tmp_path, capsys):
    router, scheduler, trace, proc = tiny_stack
    out = tmp_path / "result.json"
    code = main(["bench", "--server", router, "--scheduler", scheduler, "--num-prompts", "8",
                 "--input-len", "8", "--output-len", "8", "--json", str(out), "--no-progress"])
    assert code == 0
    result = json.loads(out.read_text())
    assert set(result) >= RESULT_KEYS
    assert result["completed"] == 8 and result["failed"] == 0
    assert result["total_output_tokens"] == 64  # EOS ignored: exactly --output-len each
    assert len(result["bubble_fraction"]) == 2
    assert "Serving Benchmark Result" in capsys.readouterr().out

    # the stack writes the run's trace on stop; the bubble picture is drawn from it
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=60)
    assert trace.exists(), "conveyor up --timeline wrote no trace on SIGTERM"
    assert plot_trace(trace, tmp_path / "bubble.png").stat().st_size > 0

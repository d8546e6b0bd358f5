"""A one-stage sync stack's recorded plans, run again alone: the same tokens as the stack's
(sync plans carry the tokens the last step sampled)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from services.bench.replay_plans import main as replay_main
from services.bench.replay_plans import replay
from services.cli import main
from services.launcher import wait_serving
from services.models.tiny import make_tiny_model
from services.worker.plan_record import read_header, runner_config
from services.worker.runner import StageRunner
from tests.conftest import free_port

ROOT = Path(__file__).resolve().parents[2]


def test_one_stage_replay_samples_the_tokens_the_stack_sampled(tmp_path, capsys):
    model = make_tiny_model(tmp_path / "tiny")
    port, plans = free_port(), tmp_path / "plans"
    log = (tmp_path / "up.log").open("w")
    argv = [sys.executable, "-m", "services.cli", "up", "--model", str(model), "--stages", "1"]
    argv += ["--port", str(port), "--threads", "1", "--kv-cache-memory", "32MiB", "--no-http"]
    argv += ["--scheduling", "sync", "--record-plans", str(plans)]
    proc = subprocess.Popen(
        argv, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=log, stderr=log
    )
    try:
        wait_serving(f"127.0.0.1:{port}", 120, proc)
        workload = ["--num-prompts", "6", "--input-len", "40", "--output-len", "12"]
        assert main(["bench", "--server", f"127.0.0.1:{port}", *workload, "--no-progress"]) == 0
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        log.close()
    recording = plans / "stage0.plans"
    header = read_header(recording)
    assert (header["stage_index"], header["num_stages"], header["num_threads"]) == (0, 1, 1)
    result = replay(StageRunner.from_config(runner_config(header)), recording)
    # every token the stack sampled and sent in a later plan, the replay samples too
    assert result.compared >= 6 * 10 and result.mismatches == 0
    capsys.readouterr()
    assert replay_main([str(recording)]) == 0
    out = capsys.readouterr().out
    assert "the recorded plans alone" in out and "the same as the stack's" in out


def test_replay_refuses_what_is_not_a_recording(tmp_path, capsys):
    other = tmp_path / "x.plans"
    other.write_text("hello")
    try:
        replay_main([str(other)])
    except SystemExit as exc:
        assert exc.code == 2
    assert "not a plan recording" in capsys.readouterr().err

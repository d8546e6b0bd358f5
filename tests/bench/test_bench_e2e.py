"""`conveyor bench` against a real stack (tiny model, 2 stages, async) started by the test."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from services.bench.plot import plot_trace
from services.bench.replay_plans import replay, stack_times
from services.cli import main
from services.common.proto.conveyor.v1 import scheduler_pb2, scheduler_pb2_grpc
from services.launcher import wait_serving
from services.models.tiny import make_tiny_model
from services.worker.plan_record import read_header, read_plans, runner_config
from services.worker.runner import StageRunner
from tests.conftest import free_port

ROOT = Path(__file__).resolve().parents[2]
RESULT_KEYS = {
    "request_throughput",
    "output_throughput",
    "total_token_throughput",
    "mean_ttft_ms",
    "median_ttft_ms",
    "p99_ttft_ms",
    "mean_tpot_ms",
    "median_tpot_ms",
    "p99_tpot_ms",
    "mean_itl_ms",
    "median_itl_ms",
    "p99_itl_ms",
    "mean_e2el_ms",
    "completed",
    "failed",
    "bubble_fraction",
    "prefix_cache_hit_rate",
    "preemptions",
}


@pytest.fixture
def tiny_stack(tmp_path):
    """`conveyor up` of a tiny model, 2 stages async with --timeline and --record-plans
    (tmp_path / "plans"); (router, scheduler, trace path, process, HTTP API), stopped at the
    end."""
    model = make_tiny_model(tmp_path / "tiny")
    port, scheduler_port, http_port = free_port(), free_port(), free_port()
    trace = tmp_path / "trace.json"
    log = (tmp_path / "up.log").open("w")
    argv = [
        sys.executable,
        "-m",
        "services.cli",
        "up",
        "--http-port",
        str(http_port),
        "--model",
        str(model),
        "--stages",
        "2",
        "--port",
        str(port),
        "--scheduler-port",
        str(scheduler_port),
        "--threads",
        "1",
        "--kv-cache-memory",
        "32MiB",
        "--timeline",
        str(trace),
        "--record-plans",
        str(tmp_path / "plans"),
    ]
    proc = subprocess.Popen(
        argv,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        wait_serving(f"127.0.0.1:{port}", 120, proc)
        yield (
            f"127.0.0.1:{port}",
            f"127.0.0.1:{scheduler_port}",
            trace,
            proc,
            f"127.0.0.1:{http_port}",
        )
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
    router, scheduler, trace, proc, http = tiny_stack
    out = tmp_path / "result.json"
    code = main(
        [
            "bench",
            "--server",
            router,
            "--scheduler",
            scheduler,
            "--num-prompts",
            "8",
            "--input-len",
            "8",
            "--output-len",
            "8",
            "--json",
            str(out),
            "--no-progress",
        ]
    )
    assert code == 0
    result = json.loads(out.read_text())
    assert set(result) >= RESULT_KEYS
    assert result["completed"] == 8 and result["failed"] == 0
    assert result["total_output_tokens"] == 64  # EOS ignored: exactly --output-len each
    assert len(result["bubble_fraction"]) == 2
    assert "Serving Benchmark Result" in capsys.readouterr().out

    # a burst held in the scheduler's queue, then released whole: planned in one step
    plans_file = tmp_path / "plans" / "stage0.plans"
    num_before = sum(1 for _ in read_plans(plans_file))
    workload = ["--num-prompts", "8", "--input-len", "8", "--output-len", "8", "--no-progress"]
    held = tmp_path / "held.json"
    bench_held = ["bench", "--server", router, "--scheduler", scheduler, "--release-at-once"]
    assert main([*bench_held, *workload, "--seed", "3", "--json", str(held)]) == 0
    result = json.loads(held.read_text())
    assert result["released_at_once"] and result["completed"] == 8
    assert result["total_output_tokens"] == 64
    held_plans = [p for p in list(read_plans(plans_file))[num_before:] if p is not None]
    assert [len(p.new_requests) for p in held_plans if p.new_requests] == [8]
    # an operator's pause is theirs: refused, and left as it was
    with grpc.insecure_channel(scheduler) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        stub.Pause(scheduler_pb2.PauseRequest(mode=scheduler_pb2.PAUSE_MODE_KEEP), timeout=30)
        capsys.readouterr()
        assert main([*bench_held, *workload]) == 2
        assert "paused already" in capsys.readouterr().err
        assert stub.GetStats(scheduler_pb2.GetStatsRequest(), timeout=30).paused
        stub.Unpause(scheduler_pb2.UnpauseRequest(), timeout=30)

    # the same workload through the OpenAI-compatible API, with the openai client
    over_http = tmp_path / "openai.json"
    code = main(
        ["bench", "--backend", "openai", "--server", http, *workload, "--json", str(over_http)]
    )
    assert code == 0
    result = json.loads(over_http.read_text())
    assert result["completed"] == 8 and result["failed"] == 0
    assert result["total_output_tokens"] == 64  # counted from the usage, as over gRPC
    assert result["mean_ttft_ms"] > 0 and result["mean_itl_ms"] > 0

    # the stack writes the run's trace on stop; the bubble picture is drawn from it
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=60)
    log = (tmp_path / "up.log").read_text()[-5000:]  # the stop's order, the scheduler's warnings
    assert trace.exists(), f"conveyor up --timeline wrote no trace on SIGTERM; its log:\n{log}"
    assert plot_trace(trace, tmp_path / "bubble.png").stat().st_size > 0

    # each stage's recorded plans run again alone, every step of the trace among them
    for stage in (0, 1):
        recording = tmp_path / "plans" / f"stage{stage}.plans"
        runner = StageRunner.from_config(runner_config(read_header(recording)))
        assert runner.model.stage.stage_index == stage
        replayed = replay(runner, recording).times
        assert sum(map(len, replayed.values())) >= 24  # three bursts of 8 prompts, 8 tokens
        for kind, steps in stack_times(trace, stage).items():
            assert len(replayed[kind]) >= len(steps)


def _children(pid: int) -> list[int]:
    """Live child processes of `pid` (from /proc)."""
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            children.append(int(stat.parent.name))
    return children


def _start_up(model: Path, port: int, trace: Path) -> subprocess.Popen:
    argv = [
        sys.executable,
        "-m",
        "services.cli",
        "up",
        "--no-http",
        "--model",
        str(model),
        "--stages",
        "2",
        "--port",
        str(port),
        "--threads",
        "1",
        "--kv-cache-memory",
        "32MiB",
        "--timeline",
        str(trace),
    ]
    return subprocess.Popen(
        argv,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def _wait_first_serving(address: str, proc: subprocess.Popen, timeout_s: float = 120) -> None:
    """Returns the moment `address` answers SERVING: a fresh channel every 20 ms, so no
    reconnect backoff delays the news (as it may for the launcher's own poll)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        with grpc.insecure_channel(address) as channel:
            try:
                reply = health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(), timeout=1.0
                )
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
        time.sleep(0.02)
    raise TimeoutError(f"{address} did not become SERVING")


def test_up_sigterm_the_moment_the_router_serves_still_stops_in_order(tmp_path):
    """The launcher may not have seen the router turn SERVING yet when a client has (it polls
    too): a SIGTERM then must stop the stack in order, not kill the launcher outright."""
    model = make_tiny_model(tmp_path / "tiny")
    port, trace = free_port(), tmp_path / "trace.json"
    proc = _start_up(model, port, trace)
    try:
        _wait_first_serving(f"127.0.0.1:{port}", proc)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert trace.exists(), "conveyor up --timeline wrote no trace on SIGTERM"


def test_up_sigterm_while_starting_stops_every_child(tmp_path):
    model = make_tiny_model(tmp_path / "tiny")
    proc = _start_up(model, free_port(), tmp_path / "trace.json")
    try:
        deadline = time.monotonic() + 60
        while len(_children(proc.pid)) < 3 and time.monotonic() < deadline:  # redis + workers
            time.sleep(0.05)
        children = _children(proc.pid)
        assert children, "conveyor up started no child"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert not [
        pid
        for pid in children
        if Path(f"/proc/{pid}").exists()
        and "Z" not in Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1][:3]
    ]


def test_release_at_once_refuses_a_burst_spread_over_two_pipelines(tmp_path, capsys):
    """Behind a router of two pipelines, the requests sent to the other pipeline run while
    the held scheduler waits: the bench says so, fails, and leaves the scheduler unpaused."""
    port, scheduler_port = free_port(), free_port()
    argv = [sys.executable, "-m", "services.cli", "up", "--no-http", "--device", "sim",
            "--model", str(ROOT / "services/worker/sim/models/llama-3-70b"), "--stages", "2",
            "--pipelines", "2", "--port", str(port), "--scheduler-port", str(scheduler_port)]  # fmt: skip
    log = (tmp_path / "up.log").open("w")
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_serving(f"127.0.0.1:{port}", 120, proc)
        scheduler = f"127.0.0.1:{scheduler_port}"
        workload = ["--num-prompts", "16", "--input-len", "16", "--output-len", "4"]
        bench = ["bench", "--server", f"127.0.0.1:{port}", "--scheduler", scheduler]
        assert main([*bench, *workload, "--no-progress", "--release-at-once"]) == 2
        assert "another pipeline" in capsys.readouterr().err
        with grpc.insecure_channel(scheduler) as channel:
            stub = scheduler_pb2_grpc.SchedulerStub(channel)
            assert not stub.GetStats(scheduler_pb2.GetStatsRequest(), timeout=30).paused
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        log.close()

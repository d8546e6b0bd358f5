"""Helpers for observability tests: a `conveyor up` stack with every diagnostic on, scrapes,
and readers of the span and event files."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[2]


def free_port_block(size: int) -> int:
    """A port N such that N .. N+size-1 are all free now."""
    for _ in range(200):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            base = sock.getsockname()[1]
        if base + size < 65536 and all(_is_free(base + i) for i in range(1, size)):
            return base
    raise RuntimeError(f"no block of {size} free ports")


def _is_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


@dataclass
class ObservedStack:
    """A running `conveyor up` with metrics, tracing to a file and the event trace."""

    proc: subprocess.Popen
    router: str
    scheduler: str
    metrics_port: int
    num_stages: int
    spans_path: Path
    events_path: Path

    def metrics_url(self, service: str, stage: int = 0) -> str:
        offset = {"router": 0, "scheduler": 1, "worker": 2 + stage}[service]
        return f"http://127.0.0.1:{self.metrics_port + offset}/metrics"

    def scrape(self, service: str, stage: int = 0) -> dict:
        """{(sample name, sorted label items): value} of one service's endpoint."""
        with urllib.request.urlopen(self.metrics_url(service, stage), timeout=10) as reply:
            text = reply.read().decode()
        samples = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
        return samples

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def start_stack(model_dir: Path, workdir: Path, num_stages: int = 2) -> ObservedStack:
    from services.launcher import wait_serving
    from tests.conftest import free_port

    port, scheduler_port = free_port(), free_port()
    metrics_port = free_port_block(2 + num_stages)
    spans, events = workdir / "spans.jsonl", workdir / "events.jsonl"
    log = (workdir / "conveyor-up.log").open("w")
    argv = [
        sys.executable,
        "-m",
        "services.cli",
        "--log-level",
        "WARNING",
        "up",
        "--no-http",
        "--model",
        str(model_dir),
        "--stages",
        str(num_stages),
        "--port",
        str(port),
        "--scheduler-port",
        str(scheduler_port),
        "--kv-cache-memory",
        "16MiB",
        "--threads",
        "1",
        "--metrics-port",
        str(metrics_port),
        "--otlp-endpoint",
        f"file://{spans}",
        "--trace-scheduler",
        str(events),
    ]
    proc = subprocess.Popen(
        argv,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    stack = ObservedStack(
        proc,
        f"127.0.0.1:{port}",
        f"127.0.0.1:{scheduler_port}",
        metrics_port,
        num_stages,
        spans,
        events,
    )
    try:
        wait_serving(stack.router, 300, proc)
    except BaseException:
        stack.stop()
        print((workdir / "conveyor-up.log").read_text()[-5000:], file=sys.stderr)
        raise
    return stack


def value(samples: dict, name: str, **labels) -> float:
    """The sample `name` with exactly `labels`, 0.0 when it is not there."""
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    lines = path.read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def wait_for(predicate, timeout_s: float = 30.0, interval_s: float = 0.2):
    """Polls `predicate` until it returns something truthy; returns that."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = predicate()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout_s} s")
        time.sleep(interval_s)

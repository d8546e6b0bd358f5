"""`conveyor up --pipelines N`: the children it starts (recorded, not run): N schedulers with
their own workers and rendezvous, named p0.., one Redis, a router over all of them."""

from __future__ import annotations

import argparse

import pytest

from services import launcher
from services.common.errors import ConfigError
from services.models.tiny import make_tiny_model
from tests.deploy.utils import flags


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("up-pipelines") / "m", num_layers=1)


def started(monkeypatch, model_dir, *argv: str) -> list[tuple[str, list[str]]]:
    parser = argparse.ArgumentParser()
    launcher.add_arguments(parser)
    args = parser.parse_args(
        ["--model", str(model_dir), "--redis-url", "redis://127.0.0.1:1/0", *argv]
    )
    spawned = []
    monkeypatch.setattr(launcher, "wait_serving", lambda *a, **k: None)
    monkeypatch.setattr(
        launcher.Stack, "spawn", lambda self, name, cmd, env=None: spawned.append((name, cmd))
    )
    launcher.start_stack(args, launcher.Stack())
    return spawned


def test_two_pipelines_get_their_own_scheduler_workers_and_rendezvous(monkeypatch, model_dir):
    spawned = started(
        monkeypatch, model_dir, "--pipelines", "2", "--stages", "2", "--cpu-affinity", "off"
    )
    schedulers = [flags(cmd) for name, cmd in spawned if cmd[0] == "scheduler"]
    workers = [flags(cmd) for name, cmd in spawned if cmd[0] == "worker"]
    (router,) = [flags(cmd) for name, cmd in spawned if cmd[0] == "router"]
    assert [s["--pipeline-id"] for s in schedulers] == ["p0", "p1"]
    assert len(workers) == 4 and len({w["--dist-addr"] for w in workers}) == 2
    worker_addrs = [s["--workers"].split(",") for s in schedulers]
    assert not set(worker_addrs[0]) & set(worker_addrs[1])
    assert {s["--redis-url"] for s in schedulers} == {"redis://127.0.0.1:1/0"}
    addresses = [s["--advertise-address"] for s in schedulers]
    assert router["--schedulers"].split(",") == addresses
    assert router["--redis-url"] == "redis://127.0.0.1:1/0"


def test_one_pipeline_starts_as_before(monkeypatch, model_dir):
    spawned = started(monkeypatch, model_dir, "--stages", "1")
    (scheduler,) = [flags(cmd) for _, cmd in spawned if cmd[0] == "scheduler"]
    (router,) = [flags(cmd) for _, cmd in spawned if cmd[0] == "router"]
    assert "--pipeline-id" not in scheduler and "--scheduler" in router
    assert [name for name, _ in spawned] == ["worker 0", "scheduler", "router"]


def test_arguments_are_refused_before_redis_starts(monkeypatch):
    """A refused `conveyor up` starts nothing: the private Redis came up before the check."""
    parser = argparse.ArgumentParser()
    launcher.add_arguments(parser)
    args = parser.parse_args(["--model", "/m"])
    monkeypatch.setattr(launcher, "RedisServer", lambda: pytest.fail("Redis was started"))
    with pytest.raises(ConfigError, match="--model /m: .*config.json"):
        launcher.start_stack(args, launcher.Stack())


@pytest.mark.parametrize(
    "failure",
    [
        TimeoutError("127.0.0.1:1 did not become SERVING within 300 s"),
        RuntimeError("the process serving 127.0.0.1:1 exited with 1"),
    ],
)
def test_a_stack_that_never_serves_exits_1_with_a_message(monkeypatch, caplog, failure):
    """A child that never served (Redis refusing the scheduler's password) or exited: one
    error line and exit 1 (it ended in a traceback)."""
    parser = argparse.ArgumentParser()
    launcher.add_arguments(parser)
    args = parser.parse_args(["--model", "/m"])

    def start_stack(*_):
        raise failure

    monkeypatch.setattr(launcher, "start_stack", start_stack)
    monkeypatch.setattr(launcher.signal, "signal", lambda *_: None)  # pytest's stay
    assert launcher.run(args) == 1
    assert "the stack did not start" in caplog.text and str(failure) in caplog.text

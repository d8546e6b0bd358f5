"""`conveyor up --speculative-config '{"model": DIR}'`: the children it starts (recorded, not
run) include a draft worker per pipeline, which the scheduler is pointed at; a draft model
with another vocabulary is refused before anything starts."""

from __future__ import annotations

import argparse
import json

import pytest

from services import launcher
from services.common.errors import ConfigError
from services.models.tiny import make_tiny_model
from tests.deploy.utils import flags


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("up-draft")
    return (
        make_tiny_model(root / "target", num_layers=1),
        make_tiny_model(root / "draft", num_layers=1, seed=3),
        make_tiny_model(root / "other-vocab", num_layers=1, vocab_size=640),
    )


def started(monkeypatch, model, draft, *argv: str) -> list[tuple[str, list[str]]]:
    parser = argparse.ArgumentParser()
    launcher.add_arguments(parser)
    spec = json.dumps({"model": str(draft), "num_speculative_tokens": 3})
    args = parser.parse_args(
        ["--model", str(model), "--redis-url", "redis://127.0.0.1:1/0"]
        + ["--speculative-config", spec, "--cpu-affinity", "off", *argv]
    )
    spawned = []
    monkeypatch.setattr(launcher, "wait_serving", lambda *a, **k: None)
    monkeypatch.setattr(
        launcher.Stack, "spawn", lambda self, name, cmd, env=None: spawned.append((name, cmd))
    )
    launcher.start_stack(args, launcher.Stack())
    return spawned


def test_up_starts_a_draft_worker_per_pipeline_and_points_the_scheduler_at_it(monkeypatch, models):
    target, draft, _ = models
    spawned = started(monkeypatch, target, draft, "--pipelines", "2", "--threads", "1")
    drafts = [(name, cmd) for name, cmd in spawned if "--draft" in cmd]
    assert [name for name, _ in drafts] == ["worker draft (p0)", "worker draft (p1)"]
    for _, cmd in drafts:
        assert flags(cmd)["--model"] == str(draft) and flags(cmd)["--threads"] == "1"
    schedulers = [flags(cmd) for _, cmd in spawned if cmd[0] == "scheduler"]
    ports = [flags(cmd)["--port"] for _, cmd in drafts]
    assert [s["--draft-worker"] for s in schedulers] == [f"127.0.0.1:{p}" for p in ports]
    assert json.loads(schedulers[0]["--speculative-config"])["method"] == "draft_model"


def test_up_refuses_a_draft_model_with_another_vocabulary(monkeypatch, models):
    target, _, other_vocab = models
    with pytest.raises(ConfigError, match="vocabulary of 640 tokens.*512"):
        started(monkeypatch, target, other_vocab)


def test_up_refuses_a_draft_model_directory_without_a_model(monkeypatch, models, tmp_path):
    target, _, _ = models
    with pytest.raises(ConfigError, match="--speculative-config: the draft model .*config.json"):
        started(monkeypatch, target, tmp_path / "nothing-here")

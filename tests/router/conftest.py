"""Fixtures of the router tests: a tiny model, a fake scheduler and one router process."""

from __future__ import annotations

import pytest

from services.models.tiny import make_tiny_model
from services.router.tokenizer import Tokenizer
from tests.router.utils import ANSWER, FakeScheduler, FakeSchedulerServer, RouterProcess


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    return make_tiny_model(
        tmp_path_factory.mktemp("router") / "tiny-chat", num_layers=1, max_position_embeddings=256
    )


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir) -> Tokenizer:
    return Tokenizer.from_dir(tiny_model_dir)


@pytest.fixture(scope="session")
def scheduler_server(tiny_tokenizer):
    fake = FakeScheduler(answer_ids=tiny_tokenizer.encode(ANSWER, add_special_tokens=False))
    server = FakeSchedulerServer(fake).start()
    yield server
    server.stop()


@pytest.fixture()
def fake(scheduler_server) -> FakeScheduler:
    """The fake scheduler, reset to its default behaviour for each test."""
    scheduler_server.fake.reset()
    scheduler_server.set_serving(True)
    return scheduler_server.fake


@pytest.fixture(scope="session")
def router(scheduler_server, tiny_model_dir):
    proc = RouterProcess(scheduler_server.address, tiny_model_dir).wait_serving()
    yield proc
    proc.stop()

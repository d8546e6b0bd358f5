"""Fixtures of the security tests: a tiny model and credentials made for the session.

Stacks of the security tests, started once per session.

* `stack`: `conveyor up` of a tiny random model (1 stage) over the `redis_url` Redis, with
  the default limits: a real router and a real scheduler, reached directly by the tests
  (as a hostile client on the network would).
* `tight_router`: a real router over the router tests' fake scheduler (tokens as fast or as
  slow as a test wants), with small capacity limits and a large prompt limit.
"""

from __future__ import annotations

import pytest

from services.models.tiny import make_tiny_model
from tests.router.utils import ANSWER, FakeScheduler, FakeSchedulerServer, RouterProcess
from tests.security.utils import TIGHT_ROUTER_ARGS, Credentials, make_credentials, start_stack


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """A 2-layer random Llama with a long context: fast enough that a stream of thousands of
    tokens is seconds, so a second client can meet it while it runs."""
    return make_tiny_model(
        tmp_path_factory.mktemp("security") / "tiny", num_layers=2, max_position_embeddings=4096
    )


@pytest.fixture(scope="session")
def credentials(tmp_path_factory) -> Credentials:
    return make_credentials(tmp_path_factory.mktemp("credentials"))


@pytest.fixture(scope="session")
def security_model_dir(tmp_path_factory):
    from services.models.tiny import make_tiny_model

    return make_tiny_model(
        tmp_path_factory.mktemp("security") / "tiny-sec", num_layers=1, max_position_embeddings=256
    )


@pytest.fixture(scope="session")
def stack(security_model_dir, redis_url, tmp_path_factory):
    running = start_stack(security_model_dir, redis_url, tmp_path_factory.mktemp("stack"))
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture(scope="session")
def fake_scheduler(security_model_dir):
    from services.router.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(security_model_dir)
    fake = FakeScheduler(answer_ids=tokenizer.encode(ANSWER, add_special_tokens=False))
    server = FakeSchedulerServer(fake).start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def tight_router(fake_scheduler, security_model_dir):
    proc = RouterProcess(fake_scheduler.address, security_model_dir, *TIGHT_ROUTER_ARGS)
    proc.wait_serving()
    yield proc
    proc.stop()


@pytest.fixture()
def fake(fake_scheduler) -> FakeScheduler:
    """The fake scheduler, reset for each test."""
    fake_scheduler.fake.reset()
    fake_scheduler.set_serving(True)
    return fake_scheduler.fake

"""One `conveyor up` stack (tiny model, 2 stages, async) over a Redis the tests control,
shared by the fault tests and the soak (the stack heals what the fault tests break)."""

from __future__ import annotations

import pytest

from services.models.tiny import make_tiny_model
from tests.faults.utils import RedisProcess, UpStack


@pytest.fixture(scope="session")
def redis_proc(tmp_path_factory):
    proc = RedisProcess(tmp_path_factory.mktemp("redis")).start(fresh=True)
    yield proc
    proc.stop()


@pytest.fixture(scope="session")
def stack(tmp_path_factory, redis_proc):
    model = make_tiny_model(tmp_path_factory.mktemp("tiny") / "m", tie_word_embeddings=False)
    log = tmp_path_factory.mktemp("up") / "up.log"
    stack = UpStack(model, redis_proc, log, "--store-grace=1")
    try:
        stack.wait_serving()
        yield stack
    except BaseException:
        print(log.read_text()[-8000:])
        raise
    finally:
        stack.stop()

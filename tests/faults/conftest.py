"""One `conveyor up` stack (tiny model, 2 stages, async) over a Redis the tests control,
shared by the fault tests and the soak (the stack heals what the fault tests break)."""

from __future__ import annotations

import pytest

from tests.faults.utils import RedisProcess, serving_stack


@pytest.fixture(scope="session")
def redis_proc(tmp_path_factory):
    proc = RedisProcess(tmp_path_factory.mktemp("redis")).start(fresh=True)
    yield proc
    proc.stop()


@pytest.fixture(scope="session")
def stack(tmp_path_factory, redis_proc):
    with serving_stack(tmp_path_factory, redis_proc) as stack:
        yield stack

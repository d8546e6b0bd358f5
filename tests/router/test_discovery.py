"""Reading the pipelines' announcements from Redis: a refused password says which variable
holds it, and a Redis that refuses is asked again with backoff, not every second."""

from __future__ import annotations

import asyncio
import logging

import pytest

from services.common.redis_server import RedisServer
from services.router import pool as pool_module
from services.router.pool import SchedulerPool
from services.router.server import announcement_reader

PASSWORD = "s3cret"


@pytest.mark.parametrize("env_password", [None, "wrong"], ids=["none", "wrong"])
def test_announcements_refused_password_names_the_variables(monkeypatch, env_password):
    if env_password is None:
        monkeypatch.delenv("CONVEYOR_REDIS_PASSWORD", raising=False)
    else:
        monkeypatch.setenv("CONVEYOR_REDIS_PASSWORD", env_password)
    monkeypatch.delenv("CONVEYOR_REDIS_PASSWORD_FILE", raising=False)
    with RedisServer(password=PASSWORD) as server:
        read = announcement_reader(server.url)
        with pytest.raises(ConnectionError) as caught:
            read()
    message = str(caught.value)
    assert "refused to authenticate" in message and "CONVEYOR_REDIS_PASSWORD" in message
    assert PASSWORD not in message


def test_discovery_backs_off_while_redis_refuses(monkeypatch, caplog):
    now = [100.0]
    monkeypatch.setattr(pool_module.time, "monotonic", lambda: now[0])
    calls = []

    def discovery():
        calls.append(now[0])
        if len(calls) <= 2:
            raise ConnectionError("Redis refused")
        return []

    pool = SchedulerPool([], discovery=discovery)
    with caplog.at_level(logging.WARNING, logger="services.router.pool"):
        for t in (100.0, 100.5, 101.0, 102.0, 103.0, 103.5):  # refresh ticks
            now[0] = t
            asyncio.run(pool.refresh())
    # failed at 100 (retry after 1 s), failed at 101 (after 2 s), then read at every tick
    assert calls == [100.0, 101.0, 103.0, 103.5]
    assert "(retrying in 1 s)" in caplog.text and "(retrying in 2 s)" in caplog.text
    assert pool._discovery_delay_s == pool_module._DISCOVERY_RETRY_S[0]  # reset on success


def test_discovery_asks_a_refusing_redis_again_at_least_every_5_s(monkeypatch):
    # A router that asked again after 30 s served pipelines up to 30 s after Redis returned.
    now = [0.0]
    monkeypatch.setattr(pool_module.time, "monotonic", lambda: now[0])
    calls = []

    def discovery():
        calls.append(now[0])
        raise ConnectionError("Redis refused")

    pool = SchedulerPool([], discovery=discovery)
    for tick in range(120):  # two minutes of 1 s refresh ticks
        now[0] = float(tick)
        asyncio.run(pool.refresh())
    gaps = [b - a for a, b in zip(calls, calls[1:], strict=False)]
    assert gaps[:3] == [1.0, 2.0, 4.0] and max(gaps) == 5.0

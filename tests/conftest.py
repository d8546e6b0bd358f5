"""Fixtures shared by every test area: the real test model and a private Redis."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from services.common.redis_server import free_port  # noqa: F401 - the tests' one free_port

# Tests never compete for more than the machine's cores, and stay deterministic.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """SmolLM2-135M converted to a Hugging Face directory (fetched once, then cached)."""
    from services.models.fetch import fetch_model

    return fetch_model("smollm2-135m", progress=False)


@pytest.fixture(scope="session")
def redis_url() -> str:
    """A private redis-server on a free port, stopped at the end of the session."""
    from services.common.redis_server import RedisServer

    with RedisServer() as server:
        yield server.url


@pytest.fixture
def root_logging():
    """`cli.main` points the root logger at this test's stderr: put it back afterwards."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)

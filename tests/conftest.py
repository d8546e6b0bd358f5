"""Fixtures shared by every test area: the real test model and a private Redis."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

# Tests never compete for more than the machine's cores, and stay deterministic.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


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

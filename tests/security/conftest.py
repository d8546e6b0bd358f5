"""Fixtures of the security tests: a tiny model and credentials made for the session."""

from __future__ import annotations

import pytest

from services.models.tiny import make_tiny_model
from tests.security.utils import Credentials, make_credentials


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

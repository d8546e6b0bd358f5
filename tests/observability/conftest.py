"""One observed `conveyor up` stack (tiny random model, 2 stages) shared by this directory."""

from __future__ import annotations

import pytest

from tests.observability.utils import start_stack


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from services.models.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny")


@pytest.fixture(scope="session")
def observed_stack(tiny_model_dir, tmp_path_factory):
    stack = start_stack(tiny_model_dir, tmp_path_factory.mktemp("observed"))
    try:
        yield stack
    finally:
        stack.stop()

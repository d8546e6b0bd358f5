"""In-process pipelines: up to three compute threads share two cores."""

import pytest
import torch


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """One intra-op thread per in-process stage."""
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(num_threads)

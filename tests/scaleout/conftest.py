"""One stack of two SmolLM2 pipelines for every scale-out test (tests/scaleout/utils.py),
and the Hugging Face greedy reference of the prompts they stream."""

from __future__ import annotations

import pytest
import torch

from tests.integration.conftest import PROMPTS, hf_greedy_reference
from tests.scaleout.utils import ScaleOutStack

MAX_TOKENS = 16


@pytest.fixture(scope="module")
def prompts(smollm2_dir) -> list[list[int]]:
    from services.router.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(smollm2_dir)
    return [tokenizer.encode(text, add_special_tokens=False) for text in PROMPTS]


@pytest.fixture(scope="module")
def reference(smollm2_dir, prompts):
    """HF greedy: (tokens, per-step logits) per prompt, MAX_TOKENS new tokens."""
    torch.set_num_threads(2)
    return hf_greedy_reference(smollm2_dir, prompts, MAX_TOKENS)


@pytest.fixture(scope="module")
def stack(smollm2_dir, tmp_path_factory, request):
    workdir = tmp_path_factory.mktemp("scaleout")
    stack = ScaleOutStack(smollm2_dir, workdir)
    try:
        request.getfixturevalue("reference")  # computed while the processes start
        stack.wait_serving()
        yield stack
    except BaseException:
        print((workdir / "stack.log").read_text()[-8000:])
        raise
    finally:
        stack.stop()

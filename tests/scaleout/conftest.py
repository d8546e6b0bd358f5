"""One stack of two SmolLM2 pipelines for every scale-out test (tests/scaleout/utils.py),
and the Hugging Face greedy reference of the prompts they stream."""

from __future__ import annotations

import pytest
import torch

from tests.scaleout.utils import ScaleOutStack

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea,",
    "def fibonacci(n):",
    "List three colours:",
    "The quick brown fox",
    "Water boils at a temperature of",
    "In 1969, the first humans to walk on the Moon were",
    "Translate to French: good morning",
    "A haiku about autumn leaves:",
    "The main ingredients of a pancake are",
    "Question: What is 12 times 12? Answer:",
    "My favourite programming language is Python because",
    "The mitochondria is",
    "Here is a short story about a robot who learns to paint. The robot",
    "Dear hiring manager,",
    "import numpy as np\nx = np.arange(10)\nprint(",
]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def prompts(smollm2_dir) -> list[list[int]]:
    from services.router.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(smollm2_dir)
    return [tokenizer.encode(text, add_special_tokens=False) for text in PROMPTS]


@pytest.fixture(scope="module")
def reference(smollm2_dir, prompts):
    """HF greedy: (tokens, per-step logits) per prompt, MAX_TOKENS new tokens."""
    import transformers

    from tests.integration.weights_utils import hf_greedy

    torch.set_num_threads(2)
    model = transformers.AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    model.eval()
    return hf_greedy(model, prompts, MAX_TOKENS)


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

"""SmolLM2 prompts and their Hugging Face greedy references, shared by the pipeline tests."""

from __future__ import annotations

import pytest
import torch

from tests.integration.weights_utils import hf_greedy

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


@pytest.fixture(scope="session")
def smollm2_prompts(smollm2_dir) -> list[list[int]]:
    from services.router.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(smollm2_dir)
    return [tokenizer.encode(text, add_special_tokens=False) for text in PROMPTS]


@pytest.fixture(scope="session")
def smollm2_reference(smollm2_dir, smollm2_prompts):
    """HF greedy: (tokens, per-step logits) per prompt, 16 new tokens."""
    torch.set_num_threads(2)
    return hf_greedy_reference(smollm2_dir, smollm2_prompts, 16)


def hf_greedy_reference(model_dir, prompts: list[list[int]], max_new: int):
    """HF greedy with its KV cache: (tokens, per-step logits) per prompt."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    return hf_greedy(model, prompts, max_new)


@pytest.fixture(scope="session")
def weights(smollm2_dir, smollm2_prompts, tmp_path_factory):
    """SmolLM2 after one and two "training steps" (tests/integration/weights_utils.py)."""
    from tests.integration.weights_utils import make_weights

    torch.set_num_threads(2)
    # A short prompt, and one over 2 KV blocks (its prefix is cached across updates).
    prompts = [smollm2_prompts[0], smollm2_prompts[13] + smollm2_prompts[1]]
    return make_weights(smollm2_dir, prompts, tmp_path_factory.mktemp("trained"))

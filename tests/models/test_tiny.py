"""make_tiny_model: a random model that transformers loads and runs."""

from __future__ import annotations

import os

import pytest

from services.common.errors import ConfigError
from services.models.tiny import make_tiny_model

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def test_make_tiny_model_loads_and_generates(tmp_path):
    path = make_tiny_model(tmp_path / "tiny", num_layers=2, vocab_size=512)
    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    tok = transformers.AutoTokenizer.from_pretrained(path)
    assert isinstance(model, transformers.LlamaForCausalLM)
    assert model.config.num_key_value_heads == 2 and model.config.vocab_size == 512
    inputs = tok("Hello world 🙂", return_tensors="pt")
    assert tok.decode(inputs.input_ids[0]) == "Hello world 🙂"
    out = model.generate(**inputs, max_new_tokens=5, do_sample=False, min_new_tokens=5)
    assert out.shape[1] == inputs.input_ids.shape[1] + 5
    assert tok.eos_token == "<|im_end|>"


def test_make_tiny_model_is_deterministic_per_seed(tmp_path):
    a = make_tiny_model(tmp_path / "a", seed=1)
    b = make_tiny_model(tmp_path / "b", seed=1)
    c = make_tiny_model(tmp_path / "c", seed=2)
    weights = [(p / "model.safetensors").read_bytes() for p in (a, b, c)]
    assert weights[0] == weights[1] != weights[2]
    assert (a / "tokenizer.json").read_text() == (c / "tokenizer.json").read_text()


def test_make_tiny_model_untied_has_lm_head(tmp_path):
    from safetensors.numpy import load_file

    path = make_tiny_model(tmp_path / "untied", num_layers=1, tie_word_embeddings=False)
    assert "lm_head.weight" in load_file(str(path / "model.safetensors"))
    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    assert not torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"num_heads": 3}, "heads"),
        ({"num_kv_heads": 3}, "num_kv_heads"),
        ({"vocab_size": 100}, "vocab_size"),
        ({"architecture": "GPT2LMHeadModel"}, "GPT2"),
    ],
)
def test_make_tiny_model_rejects_impossible_shapes(tmp_path, kwargs, message):
    with pytest.raises(ConfigError, match=message):
        make_tiny_model(tmp_path / "bad", **kwargs)

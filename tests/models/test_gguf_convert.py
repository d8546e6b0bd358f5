"""GGUF -> Hugging Face conversion: weights, q/k un-permutation, config and tokenizer."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from services.common.errors import ModelLoadError
from services.models.gguf_convert import convert_gguf, hf_tensor_name, unpermute_rotary
from services.models.tiny import make_tiny_model
from tests.models.utils import llama_cpp_permute, write_gguf_from_hf

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TEXTS = [
    "The capital of France is",
    "Hello   world\n\n  indented\tand tabbed",
    "Numbers 2024, 3.14159 and 1,000,000.",
    "héllo wörld, ça va? Grüße",
    "日本語のテキスト。你好，世界。",
    "emoji 🙂👍🏽🚀 and a flag 🇫🇷",
    "<|im_start|>user\nhi<|im_end|>\n",
    "don't you'll I'm we've",
]


def _logits(model_dir, ids):
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


def test_unpermute_rotary_inverts_llama_cpp_permute():
    rng = np.random.default_rng(0)
    q = rng.standard_normal((8 * 16, 32)).astype(np.float32)
    k = rng.standard_normal((2 * 16, 32)).astype(np.float32)
    assert np.array_equal(unpermute_rotary(llama_cpp_permute(q, 8), 8), q)
    assert np.array_equal(unpermute_rotary(llama_cpp_permute(k, 2), 2), k)
    assert not np.array_equal(llama_cpp_permute(q, 8), q)


@pytest.mark.parametrize("tied", [True, False])
def test_convert_gguf_round_trip_gives_same_logits(tmp_path, tied):
    original = make_tiny_model(
        tmp_path / "orig", num_layers=2, vocab_size=400, tie_word_embeddings=tied, seed=3
    )
    gguf_path = tmp_path / "tiny.gguf"
    write_gguf_from_hf(original, gguf_path)
    converted = tmp_path / "converted"
    convert_gguf(gguf_path, converted)

    config = json.loads((converted / "config.json").read_text())
    assert config["tie_word_embeddings"] is tied
    assert config["num_key_value_heads"] == 2 and config["max_position_embeddings"] == 2048
    ids = [5, 17, 42, 99, 250, 399, 7, 8]
    torch.testing.assert_close(
        _logits(converted, ids), _logits(original, ids), atol=1e-5, rtol=1e-5
    )


def test_convert_gguf_dequantizes_q8_0(tmp_path):
    original = make_tiny_model(tmp_path / "orig", num_layers=1, hidden_size=64, vocab_size=400)
    gguf_path = tmp_path / "tiny.gguf"
    write_gguf_from_hf(original, gguf_path, quantize_embedding=True)
    convert_gguf(gguf_path, tmp_path / "converted")
    from safetensors.numpy import load_file

    before = load_file(str(original / "model.safetensors"))["model.embed_tokens.weight"]
    after = load_file(str(tmp_path / "converted" / "model.safetensors"))[
        "model.embed_tokens.weight"
    ]
    assert after.dtype == np.float32 and after.shape == before.shape
    # Q8_0: one scale per 32 weights, 8-bit codes -> error below 1% of the block max.
    assert np.abs(after - before).max() < 0.01 * np.abs(before).max()


def test_convert_gguf_tokenizer_matches_source_tokenizer(tmp_path):
    from tokenizers import Tokenizer

    original = make_tiny_model(tmp_path / "orig", num_layers=1, vocab_size=400)
    write_gguf_from_hf(original, tmp_path / "tiny.gguf")
    convert_gguf(tmp_path / "tiny.gguf", tmp_path / "converted")
    ours = Tokenizer.from_file(str(tmp_path / "converted" / "tokenizer.json"))
    source = Tokenizer.from_file(str(original / "tokenizer.json"))
    for text in TEXTS:
        assert ours.encode(text).ids == source.encode(text).ids, text
    tok_config = json.loads((tmp_path / "converted" / "tokenizer_config.json").read_text())
    assert tok_config["eos_token"] == "<|im_end|>"
    assert "chat_template" in tok_config


def test_convert_gguf_rejects_a_file_that_is_not_gguf(tmp_path):
    bogus = tmp_path / "model.gguf"
    bogus.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(ModelLoadError, match="model.gguf"):
        convert_gguf(bogus, tmp_path / "out")


def test_hf_tensor_name_maps_layers_and_rejects_unknown():
    assert hf_tensor_name("blk.12.attn_q.weight") == "model.layers.12.self_attn.q_proj.weight"
    assert hf_tensor_name("output.weight") == "lm_head.weight"
    with pytest.raises(ModelLoadError, match="rope_freqs"):
        hf_tensor_name("rope_freqs.weight")


# --- the real SmolLM2-135M -----------------------------------------------------------


def test_smollm2_greedy_continuation_names_paris(smollm2_dir):
    tok = transformers.AutoTokenizer.from_pretrained(smollm2_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(smollm2_dir)
    inputs = tok("The capital of France is", return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=8, do_sample=False)
    text = tok.decode(out[0][inputs.input_ids.shape[1] :])
    assert "Paris" in text


def test_smollm2_config_comes_from_gguf_metadata(smollm2_dir):
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (
        config["num_hidden_layers"],
        config["hidden_size"],
        config["num_attention_heads"],
        config["num_key_value_heads"],
    ) == (30, 576, 9, 3)
    assert config["max_position_embeddings"] == 8192 and config["vocab_size"] == 49152
    assert config["tie_word_embeddings"] is True
    generation = json.loads((smollm2_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == 2


def test_smollm2_tokenizer_json_encodes_like_transformers(smollm2_dir):
    from tokenizers import Tokenizer

    ours = Tokenizer.from_file(str(smollm2_dir / "tokenizer.json"))
    theirs = transformers.AutoTokenizer.from_pretrained(smollm2_dir)
    for text in TEXTS:
        ids = theirs(text, add_special_tokens=True).input_ids
        assert ours.encode(text).ids == ids, text
        assert theirs.decode(ids) == ours.decode(ids, skip_special_tokens=False) == text
    assert theirs.eos_token == "<|im_end|>" and theirs.bos_token == "<|im_start|>"

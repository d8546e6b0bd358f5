"""Factories for model tests: turn a HF Llama directory into a GGUF file the way llama.cpp does."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import numpy as np


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py `LlamaModel.permute` (HF rotary halves -> pairs)."""
    return (
        weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


_TO_GGUF = {
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
}


def _gguf_name(hf_name: str) -> str:
    globals_ = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if hf_name in globals_:
        return globals_[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    return f"blk.{layer}.{_TO_GGUF[rest]}"


def write_gguf_from_hf(model_dir: Path, gguf_path: Path, quantize_embedding: bool = False) -> None:
    """Write `model_dir` (config.json, model.safetensors, tokenizer files) as a llama GGUF.

    Matrices are stored as F32 (exact), or the token embedding as Q8_0 when asked, with
    q/k rows permuted as llama.cpp does, so that converting back must undo it.
    """
    import gguf
    from safetensors.numpy import load_file

    config = json.loads((model_dir / "config.json").read_text())
    tok_json = json.loads((model_dir / "tokenizer.json").read_text())
    tok_config = json.loads((model_dir / "tokenizer_config.json").read_text())
    writer = gguf.GGUFWriter(str(gguf_path), "llama")
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(config["rope_theta"])
    writer.add_rope_dimension_count(config["hidden_size"] // config["num_attention_heads"])
    writer.add_vocab_size(config["vocab_size"])
    _add_tokenizer(writer, tok_json, tok_config, config["vocab_size"])
    for name, array in load_file(str(model_dir / "model.safetensors")).items():
        if name.endswith("q_proj.weight"):
            array = llama_cpp_permute(array, config["num_attention_heads"])
        elif name.endswith("k_proj.weight"):
            array = llama_cpp_permute(array, config["num_key_value_heads"])
        if quantize_embedding and name == "model.embed_tokens.weight":
            qtype = gguf.GGMLQuantizationType.Q8_0
            writer.add_tensor(_gguf_name(name), gguf.quants.quantize(array, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(_gguf_name(name), np.ascontiguousarray(array, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _add_tokenizer(writer, tok_json: dict, tok_config: dict, vocab_size: int) -> None:
    """GGUF tokenizer metadata from a byte-level BPE tokenizer.json (padded to vocab_size)."""
    vocab = dict(tok_json["model"]["vocab"])
    specials = {added["content"]: added["id"] for added in tok_json["added_tokens"]}
    vocab.update(specials)
    tokens = [None] * len(vocab)
    for token, token_id in vocab.items():
        tokens[token_id] = token
    types = [3 if token in specials else 1 for token in tokens]
    for pad in range(len(tokens), vocab_size):  # unused embedding rows, as llama.cpp pads
        tokens.append(f"[PAD{pad}]")
        types.append(4)
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok_json["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(vocab[tok_config["bos_token"]])
    writer.add_eos_token_id(vocab[tok_config["eos_token"]])
    writer.add_pad_token_id(vocab[tok_config["pad_token"]])
    writer.add_chat_template(tok_config["chat_template"])


def write_fake_wheel(wheel_path: Path, member: str, gguf_path: Path) -> Path:
    """A zip archive holding `gguf_path` at `member`, standing in for the PyPI wheel."""
    with zipfile.ZipFile(wheel_path, "w") as archive:
        archive.write(gguf_path, member)
    return wheel_path

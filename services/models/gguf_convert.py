"""Convert a llama.cpp GGUF file (Llama family) into a Hugging Face model directory.

The directory holds what `transformers` and Conveyor's workers read:

    config.json              LlamaForCausalLM hyper-parameters, from the GGUF metadata
    generation_config.json   bos / eos / pad ids
    model.safetensors        every weight dequantized to float32, under HF Llama names
    tokenizer.json           byte-level BPE rebuilt from the GGUF vocabulary (gguf_tokenizer.py)
    tokenizer_config.json    special tokens and the chat template

Quantized weights (Q4_1, Q8_0, ...) are dequantized with `gguf.quants.dequantize`; the
result is the quantized model's exact weights in float32, not the original bf16 ones.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from services.common.errors import ModelLoadError
from services.models.gguf_tokenizer import write_tokenizer_files

logger = logging.getLogger(__name__)

# GGUF per-layer tensor name -> HF Llama per-layer name (both without the layer prefix).
_LAYER_NAMES = {
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


@dataclass(slots=True)
class LlamaHParams:
    """The Llama hyper-parameters a GGUF file's metadata carries."""

    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    vocab_size: int


def _field(reader, key: str, default=None):
    """One scalar or string metadata value, or `default` when the key is absent."""
    field = reader.fields.get(key)
    if field is None:
        if default is None:
            raise ModelLoadError(f"GGUF metadata lacks {key!r}; is this a Llama-family GGUF file?")
        return default
    return field.contents()


def read_hparams(reader) -> LlamaHParams:
    """Read the Llama hyper-parameters from a GGUFReader's metadata."""
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ModelLoadError(f"GGUF architecture is {arch!r}; only 'llama' can be converted")
    hidden = int(_field(reader, "llama.embedding_length"))
    num_heads = int(_field(reader, "llama.attention.head_count"))
    num_tokens = len(reader.fields["tokenizer.ggml.tokens"].data)
    return LlamaHParams(
        num_layers=int(_field(reader, "llama.block_count")),
        hidden_size=hidden,
        intermediate_size=int(_field(reader, "llama.feed_forward_length")),
        num_heads=num_heads,
        num_kv_heads=int(_field(reader, "llama.attention.head_count_kv", num_heads)),
        head_dim=int(_field(reader, "llama.rope.dimension_count", hidden // num_heads)),
        max_position_embeddings=int(_field(reader, "llama.context_length")),
        # float32 in the file: 1e-5 reads back as 9.99999975e-06, keep the short decimal
        rms_norm_eps=float(f"{_field(reader, 'llama.attention.layer_norm_rms_epsilon'):.7g}"),
        rope_theta=float(f"{_field(reader, 'llama.rope.freq_base', 10000.0):.7g}"),
        vocab_size=int(_field(reader, "llama.vocab_size", num_tokens)),
    )


def unpermute_rotary(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (convert_hf_to_gguf.py `LlamaModel.permute`).

    HF Llama stores each head's rows as [first halves of the rotary pairs | second halves];
    llama.cpp interleaves them (pair i at rows 2i, 2i+1). llama.cpp's forward permutation is
    `reshape(H, 2, D/2, ...).swapaxes(1, 2)`; the inverse reshapes to (H, D/2, 2, ...) and
    swaps back. `num_heads` is the head count for q and the kv-head count for k.
    """
    rows = weight.shape[0]
    head_dim = rows // num_heads
    return (
        weight.reshape(num_heads, head_dim // 2, 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def hf_tensor_name(gguf_name: str) -> str:
    """Map a GGUF tensor name (`blk.3.attn_q.weight`) to its HF Llama name."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}"
    raise ModelLoadError(f"GGUF tensor {gguf_name!r} has no Llama counterpart; cannot convert")


def read_weights(reader, hparams: LlamaHParams, progress: bool = False) -> dict[str, np.ndarray]:
    """Dequantize every tensor to float32 under its HF name, q/k rows un-permuted."""
    from gguf.quants import dequantize
    from tqdm import tqdm

    weights: dict[str, np.ndarray] = {}
    for tensor in tqdm(reader.tensors, desc="dequantize", unit="tensor", disable=not progress):
        name = hf_tensor_name(tensor.name)
        # numpy shape is the GGUF shape reversed: [out_features, in_features] as in HF.
        array = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        if name.endswith("q_proj.weight"):
            array = unpermute_rotary(array, hparams.num_heads)
        elif name.endswith("k_proj.weight"):
            array = unpermute_rotary(array, hparams.num_kv_heads)
        weights[name] = np.ascontiguousarray(array)
    _check_weights(weights, hparams)
    return weights


def _check_weights(weights: dict[str, np.ndarray], hparams: LlamaHParams) -> None:
    """Fail early when the GGUF lacks a layer or a shape disagrees with its metadata."""
    embed = weights.get("model.embed_tokens.weight")
    if embed is None or embed.shape != (hparams.vocab_size, hparams.hidden_size):
        shape = None if embed is None else embed.shape
        raise ModelLoadError(
            f"GGUF token embedding has shape {shape}, metadata says "
            f"({hparams.vocab_size}, {hparams.hidden_size})"
        )
    for layer in range(hparams.num_layers):
        for hf_name in _LAYER_NAMES.values():
            if f"model.layers.{layer}.{hf_name}" not in weights:
                raise ModelLoadError(f"GGUF file lacks layer {layer}'s {hf_name}")


def llama_config(
    hparams: LlamaHParams, *, tie_word_embeddings: bool, bos_id, eos_id, pad_id
) -> dict:
    """The config.json of a LlamaForCausalLM with these hyper-parameters."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hparams.hidden_size,
        "intermediate_size": hparams.intermediate_size,
        "num_hidden_layers": hparams.num_layers,
        "num_attention_heads": hparams.num_heads,
        "num_key_value_heads": hparams.num_kv_heads,
        "head_dim": hparams.head_dim,
        "max_position_embeddings": hparams.max_position_embeddings,
        "rms_norm_eps": hparams.rms_norm_eps,
        "rope_theta": hparams.rope_theta,
        "rope_scaling": None,
        "vocab_size": hparams.vocab_size,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "tie_word_embeddings": tie_word_embeddings,
        "torch_dtype": "float32",
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "pad_token_id": pad_id,
    }


def write_json(path: Path, data: dict) -> None:
    """Write `data` as indented UTF-8 JSON."""
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def convert_gguf(gguf_path: Path, out_dir: Path, progress: bool = False) -> None:
    """Convert a Llama GGUF file into a Hugging Face directory at `out_dir` (created).

    Raises:
        ModelLoadError: the file is not a readable Llama GGUF.
    """
    from gguf import GGUFReader
    from safetensors.numpy import save_file

    try:
        reader = GGUFReader(str(gguf_path))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read GGUF file {gguf_path}: {exc}") from exc
    hparams = read_hparams(reader)
    weights = read_weights(reader, hparams, progress=progress)
    tie = "lm_head.weight" not in weights
    out_dir.mkdir(parents=True, exist_ok=True)
    special = write_tokenizer_files(reader, out_dir, hparams.max_position_embeddings)
    config = llama_config(
        hparams,
        tie_word_embeddings=tie,
        bos_id=special.bos_id,
        eos_id=special.eos_id,
        pad_id=special.pad_id,
    )
    write_json(out_dir / "config.json", config)
    generation = {"bos_token_id": special.bos_id, "eos_token_id": special.eos_id}
    if special.pad_id is not None:
        generation["pad_token_id"] = special.pad_id
    write_json(out_dir / "generation_config.json", generation)
    save_file(weights, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "model.safetensors").chmod(0o644)  # safetensors creates it 0600
    logger.info("converted %s to %s (%d tensors, tied=%s)", gguf_path, out_dir, len(weights), tie)

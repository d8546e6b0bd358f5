"""Write a tiny random Llama model directory for fast tests.

The directory has the same files as a converted real model (config.json, model.safetensors
in float32 under HF Llama names, tokenizer.json, tokenizer_config.json with a chat template,
generation_config.json), so every code path that loads a model can run on it in
milliseconds. The tokenizer is a real byte-level BPE (~400 tokens) trained on a short
built-in text, so any UTF-8 string round-trips.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from services.common.config import check_output_dir
from services.common.errors import ConfigError
from services.models.gguf_convert import LlamaHParams, llama_config, write_json

logger = logging.getLogger(__name__)

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
EOS_TOKEN = "<|im_end|>"
TOKENIZER_VOCAB_SIZE = 400
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM")

# ChatML, the same shape as SmolLM2's template, with a default system prompt.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a tiny test model.<|im_end|>\n' }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_TRAINING_TEXT = """\
The quick brown fox jumps over the lazy dog. The capital of France is Paris.
Pipeline parallelism splits the layers of a model into stages; each stage runs on its own
worker and passes hidden states to the next one. The scheduler plans every step.
Once upon a time there was a small model that answered every question with a story.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 2024. Symbols: ( ) [ ] { } < > = + - * / % & | !
def main():\n    return sum(x * x for x in range(10))\n
Héllo wörld, ça va? Grüße aus München. 日本語のテキスト。 你好，世界。 🙂 👍 🚀
"""


def train_tokenizer(vocab_size: int = TOKENIZER_VOCAB_SIZE):
    """A byte-level BPE `tokenizers.Tokenizer` trained on the built-in text (deterministic)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(_TRAINING_TEXT.splitlines(keepends=True) * 4, trainer=trainer)
    return tokenizer


def _random_weights(hparams: LlamaHParams, tie: bool, seed: int) -> dict[str, np.ndarray]:
    """Normal(0, 0.02) matrices and unit norms under HF Llama names."""
    rng = np.random.default_rng(seed)
    hidden, inter, head_dim = hparams.hidden_size, hparams.intermediate_size, hparams.head_dim

    def matrix(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) * 0.02).astype(np.float32)

    weights = {"model.embed_tokens.weight": matrix(hparams.vocab_size, hidden)}
    for layer in range(hparams.num_layers):
        prefix = f"model.layers.{layer}."
        weights |= {
            prefix + "self_attn.q_proj.weight": matrix(hparams.num_heads * head_dim, hidden),
            prefix + "self_attn.k_proj.weight": matrix(hparams.num_kv_heads * head_dim, hidden),
            prefix + "self_attn.v_proj.weight": matrix(hparams.num_kv_heads * head_dim, hidden),
            prefix + "self_attn.o_proj.weight": matrix(hidden, hparams.num_heads * head_dim),
            prefix + "mlp.gate_proj.weight": matrix(inter, hidden),
            prefix + "mlp.up_proj.weight": matrix(inter, hidden),
            prefix + "mlp.down_proj.weight": matrix(hidden, inter),
            prefix + "input_layernorm.weight": np.ones(hidden, dtype=np.float32),
            prefix + "post_attention_layernorm.weight": np.ones(hidden, dtype=np.float32),
        }
    weights["model.norm.weight"] = np.ones(hidden, dtype=np.float32)
    if not tie:
        weights["lm_head.weight"] = matrix(hparams.vocab_size, hidden)
    return weights


def _validate(
    num_layers: int,
    hidden_size: int,
    num_heads: int,
    num_kv_heads: int,
    vocab_size: int,
    architecture: str,
) -> None:
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ConfigError(f"architecture {architecture!r} is not one of {SUPPORTED_ARCHITECTURES}")
    if num_layers < 1 or hidden_size < 1 or num_heads < 1 or num_kv_heads < 1:
        raise ConfigError("num_layers, hidden_size, num_heads and num_kv_heads must all be >= 1")
    if hidden_size % num_heads or (hidden_size // num_heads) % 2:
        raise ConfigError(
            f"hidden_size {hidden_size} must split into {num_heads} heads of an even size"
        )
    if num_heads % num_kv_heads:
        raise ConfigError(
            f"num_heads {num_heads} must be a multiple of num_kv_heads {num_kv_heads}"
        )
    if vocab_size < TOKENIZER_VOCAB_SIZE:
        raise ConfigError(
            f"vocab_size {vocab_size} is smaller than the tiny tokenizer ({TOKENIZER_VOCAB_SIZE})"
        )


def make_tiny_model(
    dir: Path | str,
    num_layers: int = 4,
    hidden_size: int = 64,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    vocab_size: int = 512,
    tie_word_embeddings: bool = True,
    seed: int = 0,
    architecture: str = "LlamaForCausalLM",
    intermediate_size: int | None = None,
    max_position_embeddings: int = 2048,
) -> Path:
    """Write a random model directory at `dir` (created) and return its path.

    `vocab_size` may exceed the tokenizer's ~400 tokens (ids past it are never produced by
    the tokenizer but exist in the embedding, as in padded real vocabularies). The same
    arguments and seed always give the same weights.

    Raises:
        ConfigError: sizes that cannot form a Llama model, an unsupported architecture, or
            a `dir` that cannot be written.
    """
    from safetensors.numpy import save_file

    _validate(num_layers, hidden_size, num_heads, num_kv_heads, vocab_size, architecture)
    out = Path(dir)
    check_output_dir(out, "the model directory")
    tokenizer = train_tokenizer()
    eos_id = tokenizer.token_to_id(EOS_TOKEN)
    bos_id = tokenizer.token_to_id("<|im_start|>")
    pad_id = tokenizer.token_to_id("<|endoftext|>")
    hparams = LlamaHParams(
        num_layers=num_layers,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 2 * hidden_size,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=hidden_size // num_heads,
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        vocab_size=vocab_size,
    )
    config = llama_config(
        hparams,
        tie_word_embeddings=tie_word_embeddings,
        bos_id=bos_id,
        eos_id=eos_id,
        pad_id=pad_id,
    )
    config["architectures"] = [architecture]
    config["model_type"] = "mistral" if architecture == "MistralForCausalLM" else "llama"
    write_json(out / "config.json", config)
    write_json(
        out / "generation_config.json",
        {"bos_token_id": bos_id, "eos_token_id": eos_id, "pad_token_id": pad_id},
    )
    tokenizer.save(str(out / "tokenizer.json"))
    write_json(
        out / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "add_bos_token": False,
            "add_prefix_space": False,
            "clean_up_tokenization_spaces": False,
            "model_max_length": max_position_embeddings,
            "bos_token": "<|im_start|>",
            "eos_token": EOS_TOKEN,
            "pad_token": "<|endoftext|>",
            "unk_token": "<|endoftext|>",
            "chat_template": CHAT_TEMPLATE,
        },
    )
    weights = _random_weights(hparams, tie_word_embeddings, seed)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "model.safetensors").chmod(0o644)
    logger.info(
        "wrote tiny %s (%d layers, hidden %d) to %s", architecture, num_layers, hidden_size, out
    )
    return out

"""Rebuild a Hugging Face `tokenizer.json` from a GGUF file's vocabulary.

Only llama.cpp's `gpt2` tokenizer model (byte-level BPE) is supported. The pre-tokenizer
follows llama.cpp's `tokenizer.ggml.pre` name: SmolLM2 (`smollm`) splits every digit on its
own and then applies GPT-2's byte-level regex, which is what its original tokenizer.json
does (`Digits(individual_digits=True)` then `ByteLevel(add_prefix_space=False)`). No
post-processor adds a BOS token, as in the original.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

from services.common.errors import ModelLoadError

logger = logging.getLogger(__name__)

# gguf TokenType values (llama.cpp llama_token_type).
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4

# llama.cpp pre-tokenizer names whose regex starts with a single-digit split (\p{N}).
_DIGIT_SPLIT_PRE = {"smollm", "starcoder", "refact", "codeshell", "command-r", "exaone", "minerva"}
# llama.cpp pre-tokenizer names that use the plain GPT-2 regex.
_GPT2_PRE = {"default", "gpt-2", "gpt2", "olmo", "jais", "poro-chat", "viking"}


@dataclass(slots=True)
class SpecialTokens:
    """Ids and strings of the special tokens a converted model declares."""

    bos_id: int | None
    eos_id: int | None
    pad_id: int | None
    unk_id: int | None
    tokens: list[str]

    def text(self, token_id: int | None) -> str | None:
        """The token string of `token_id`, or None when the id is None."""
        return None if token_id is None else self.tokens[token_id]


def _optional_id(reader, key: str) -> int | None:
    field = reader.fields.get(key)
    return None if field is None else int(field.contents())


def build_tokenizer(tokens: list[str], merges: list[str], token_types: list[int], pre: str):
    """A `tokenizers.Tokenizer` equal to the original byte-level BPE tokenizer.

    Args:
        tokens: the vocabulary, index = token id.
        merges: BPE merges as "left right" strings, highest priority first.
        token_types: gguf token type per id; control tokens become special added tokens.
        pre: llama.cpp's pre-tokenizer name (`tokenizer.ggml.pre`).
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    if pre in _DIGIT_SPLIT_PRE:
        pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    elif pre in _GPT2_PRE:
        pre_tokenizer = byte_level
    else:
        raise ModelLoadError(
            f"GGUF pre-tokenizer {pre!r} is not supported; supported: "
            f"{sorted(_DIGIT_SPLIT_PRE | _GPT2_PRE)}"
        )
    vocab = {token: token_id for token_id, token in enumerate(tokens)}
    pairs = [tuple(merge.split(" ", 1)) for merge in merges]
    tokenizer = Tokenizer(
        models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False)
    )
    tokenizer.pre_tokenizer = pre_tokenizer
    tokenizer.decoder = decoders.ByteLevel(
        add_prefix_space=False, trim_offsets=True, use_regex=True
    )
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    added = [
        AddedToken(token, special=kind == _TOKEN_TYPE_CONTROL, normalized=False)
        for token, kind in zip(tokens, token_types, strict=True)
        if kind in (_TOKEN_TYPE_CONTROL, _TOKEN_TYPE_USER_DEFINED)
    ]
    tokenizer.add_tokens(added)
    return tokenizer


def read_special_tokens(reader, tokens: list[str]) -> SpecialTokens:
    """The bos/eos/pad/unk ids the GGUF metadata declares (None where absent)."""
    return SpecialTokens(
        bos_id=_optional_id(reader, "tokenizer.ggml.bos_token_id"),
        eos_id=_optional_id(reader, "tokenizer.ggml.eos_token_id"),
        pad_id=_optional_id(reader, "tokenizer.ggml.padding_token_id"),
        unk_id=_optional_id(reader, "tokenizer.ggml.unknown_token_id"),
        tokens=tokens,
    )


def tokenizer_config(special: SpecialTokens, chat_template: str | None, max_length: int) -> dict:
    """tokenizer_config.json for `PreTrainedTokenizerFast` over our tokenizer.json."""
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": False,
        "add_eos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_length,
    }
    for name, token_id in (
        ("bos", special.bos_id),
        ("eos", special.eos_id),
        ("pad", special.pad_id),
        ("unk", special.unk_id),
    ):
        if token_id is not None:
            config[f"{name}_token"] = special.text(token_id)
    if chat_template:
        config["chat_template"] = chat_template
    return config


def write_tokenizer_files(reader, out_dir: Path, max_length: int) -> SpecialTokens:
    """Write tokenizer.json and tokenizer_config.json from a GGUFReader; return the specials."""
    model = reader.fields.get("tokenizer.ggml.model")
    kind = None if model is None else model.contents()
    if kind != "gpt2":
        raise ModelLoadError(
            f"GGUF tokenizer model is {kind!r}; only 'gpt2' (byte-level BPE) is supported"
        )
    tokens = list(reader.fields["tokenizer.ggml.tokens"].contents())
    merges = list(reader.fields["tokenizer.ggml.merges"].contents())
    types_field = reader.fields.get("tokenizer.ggml.token_type")
    token_types = [1] * len(tokens) if types_field is None else list(types_field.contents())
    pre_field = reader.fields.get("tokenizer.ggml.pre")
    pre = "default" if pre_field is None else pre_field.contents()
    tokenizer = build_tokenizer(tokens, merges, token_types, pre)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    special = read_special_tokens(reader, tokens)
    template_field = reader.fields.get("tokenizer.chat_template")
    template = None if template_field is None else template_field.contents()
    config = tokenizer_config(special, template, max_length)
    (out_dir / "tokenizer_config.json").write_text(
        json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8"
    )
    logger.info("tokenizer: %d tokens, %d merges, pre=%s", len(tokens), len(merges), pre)
    return special

"""The router's tokenizer: a model's own tokenizer.json plus its chat template.

Only the HF `tokenizers` library is used at runtime (no transformers import), reading:

    tokenizer.json           the tokenizer itself (required)
    tokenizer_config.json    special token strings, chat_template (optional)
    generation_config.json   bos / eos ids (optional; wins over tokenizer_config)
    chat_template.jinja      a template kept in its own file (optional; wins if present)

Encoding with `add_special_tokens=True` runs the tokenizer.json post-processor exactly as
transformers does (e.g. a Llama-2 BOS). Prompts rendered from a chat template already hold
their special tokens as text, so encode them with `add_special_tokens=False`, as
transformers' `apply_chat_template(tokenize=True)` does.
"""

from __future__ import annotations

import functools
import json
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.common.errors import ModelLoadError
from services.router.chat_template import render_chat_template

logger = logging.getLogger(__name__)

_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")
"""A SentencePiece byte-fallback token (Llama-2 spells a byte it has no piece for so)."""


@functools.cache
def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE spells each byte as one printable character: character ->
    byte (the printable ASCII and Latin-1 bytes as themselves, the rest from U+0100 on)."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    kept += range(ord("®"), ord("ÿ") + 1)
    moved = [b for b in range(256) if b not in kept]
    alphabet = {chr(b): b for b in kept}
    alphabet.update({chr(256 + i): b for i, b in enumerate(moved)})
    return alphabet


def _read_json(path: Path) -> dict:
    """A JSON object from `path`, {} when the file does not exist."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} must hold a JSON object, found {type(data).__name__}")
    return data


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


@dataclass(slots=True)
class Tokenizer:
    """A loaded tokenizer. Build it with `Tokenizer.from_dir(model_dir)`."""

    backend: Any  # tokenizers.Tokenizer
    special_tokens: dict[str, str]  # template variables: bos_token, eos_token, ...
    eos_token_ids: list[int]  # every id that ends generation (generation_config may list several)
    bos_token_id: int | None = None
    chat_template: str | None = None
    model_dir: Path | None = None
    _special_ids: frozenset[int] = field(default_factory=frozenset)
    _is_byte_level: bool = False

    @classmethod
    def from_dir(cls, model_dir: Path | str) -> Tokenizer:
        """Load the tokenizer files of a Hugging Face model directory.

        Raises:
            ModelLoadError: tokenizer.json is missing or unreadable, or a config is corrupt.
        """
        from tokenizers import Tokenizer as HFTokenizer

        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise ModelLoadError(
                f"{path} does not exist; the model directory needs a Hugging Face tokenizer.json "
                "(`conveyor models fetch` and `conveyor models make-tiny` write one)"
            )
        try:
            backend = HFTokenizer.from_file(str(path))
        except Exception as exc:  # tokenizers raises plain Exception on bad JSON
            raise ModelLoadError(f"{path} is not a valid tokenizer.json: {exc}") from exc
        config = _read_json(model_dir / "tokenizer_config.json")
        generation = _read_json(model_dir / "generation_config.json")
        special = {
            key: text
            for key in _SPECIAL_TOKEN_KEYS
            if (text := _token_text(config.get(key))) is not None
        }
        eos_ids = _as_id_list(generation.get("eos_token_id"))
        if not eos_ids and "eos_token" in special:
            eos_ids = _as_id_list(backend.token_to_id(special["eos_token"]))
        bos_id = generation.get("bos_token_id")
        if bos_id is None and "bos_token" in special:
            bos_id = backend.token_to_id(special["bos_token"])
        template = config.get("chat_template")
        template_file = model_dir / "chat_template.jinja"
        if template_file.is_file():
            template = template_file.read_text(encoding="utf-8")
        special_ids = frozenset(
            token_id
            for token_id, added in backend.get_added_tokens_decoder().items()
            if added.special
        )
        return cls(
            backend=backend,
            special_tokens=special,
            eos_token_ids=eos_ids,
            bos_token_id=None if bos_id is None else int(bos_id),
            chat_template=template if isinstance(template, str) else None,
            model_dir=model_dir,
            _special_ids=special_ids,
            _is_byte_level=type(backend.decoder).__name__ == "ByteLevel",
        )

    @property
    def eos_token_id(self) -> int | None:
        """The first end-of-sequence id (None when the model declares none)."""
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer can produce, added tokens included."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def is_special(self, token_id: int) -> bool:
        """True for special tokens (those `skip_special_tokens` drops)."""
        return token_id in self._special_ids

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; `add_special_tokens` runs the post-processor (e.g. BOS).

        Goes through `encode_batch`, which releases the GIL (`encode` holds it): a megabyte
        prompt tokenized in a worker thread then leaves the event loop free."""
        return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        """Text of `ids`; invalid UTF-8 (a character cut between tokens) becomes U+FFFD."""
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (OpenAI's logprobs `bytes`: a character split
        across tokens is rebuilt by joining them): a byte-level token's own bytes, a
        byte-fallback token's byte, else the UTF-8 of its text."""
        piece = self.backend.id_to_token(token_id)
        if piece is not None and not self.is_special(token_id):
            alphabet = _byte_level_alphabet()
            if self._is_byte_level and all(c in alphabet for c in piece):
                return bytes(alphabet[c] for c in piece)
            if match := _BYTE_FALLBACK.fullmatch(piece):
                return bytes([int(match[1], 16)])
        return self.decode([token_id]).encode()

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary string of one id (byte-level form), None when out of range."""
        return self.backend.id_to_token(token_id)

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """Render `messages` with the model's chat template, as transformers would.

        Raises:
            ModelLoadError: the model has no chat template.
            InvalidRequest: the template rejected the messages.
        """
        if not self.chat_template:
            raise ModelLoadError(
                f"model {self.model_dir} has no chat template (tokenizer_config.json "
                "'chat_template' or chat_template.jinja); send a plain prompt instead"
            )
        return render_chat_template(
            self.chat_template,
            messages,
            self.special_tokens,
            add_generation_prompt=add_generation_prompt,
            **kwargs,
        )

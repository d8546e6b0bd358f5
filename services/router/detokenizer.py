"""Incremental, UTF-8-safe detokenization for streaming (vLLM / TGI `decode_token`).

A character may be split across tokens (byte-level BPE spells an emoji as up to four byte
tokens). Decoding a token alone would then yield U+FFFD, so each step decodes a small
window and emits only text that is final:

    ids:   ... | prefix_offset ........ read_offset ........ len(ids)
                 └ already emitted, kept ┘└ not yet emitted ┘
                   as context

    prefix_text = decode(ids[prefix_offset:read_offset])
    new_text    = decode(ids[prefix_offset:])
    emit new_text[len(prefix_text):] unless new_text ends with U+FFFD (wait for more bytes)

The context window matters for tokenizers whose decode of a lone token differs from its
decode in context (SentencePiece drops a leading space at the start of a string). The
concatenation of every `step()` and the final `flush()` equals `decode(generated ids)`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from services.router.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens kept as decoding context, as in vLLM (INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET).
PROMPT_CONTEXT_TOKENS = 5
INVALID_RUN = REPLACEMENT_CHAR * 2
"""A character still waiting for its last bytes decodes as one U+FFFD; two in a row at the
end are invalid bytes that no later token completes, so they go out as they are. (Held back,
every step decoded the whole run again: a long run of invalid byte tokens cost quadratic
time on the router's event loop.)"""


@dataclass(slots=True)
class IncrementalDetokenizer:
    """Per-request streaming state; feed generated ids to `step()`, call `flush()` at the end."""

    tokenizer: Tokenizer
    skip_special_tokens: bool = True
    ids: list[int] = field(default_factory=list)  # context + generated ids not yet dropped
    prefix_offset: int = 0
    read_offset: int = 0
    num_generated: int = 0

    @classmethod
    def for_prompt(
        cls, tokenizer: Tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True
    ) -> IncrementalDetokenizer:
        """A detokenizer whose first tokens decode in the context of the prompt's tail."""
        context = list(prompt_ids[-PROMPT_CONTEXT_TOKENS:])
        return cls(
            tokenizer=tokenizer,
            skip_special_tokens=skip_special_tokens,
            ids=context,
            prefix_offset=0,
            read_offset=len(context),
        )

    @classmethod
    def for_resume(
        cls, tokenizer: Tokenizer, output_ids: list[int], skip_special_tokens: bool = True
    ) -> IncrementalDetokenizer:
        """A detokenizer that goes on after `output_ids`, the last output tokens the client
        already has (Resume). Their text was streamed, except a character still waiting for
        its last bytes: those ids are left unread, so the character comes out whole with
        the token that completes it."""
        context = list(output_ids[-PROMPT_CONTEXT_TOKENS:])
        detok = cls(tokenizer=tokenizer, skip_special_tokens=skip_special_tokens, ids=context)
        read = len(context)
        while read and detok._decode(context[:read]).endswith(REPLACEMENT_CHAR):
            read -= 1
        detok.read_offset = read
        return detok

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def step(self, new_token_ids: list[int]) -> str:
        """Append generated ids; return the text that became final (maybe "")."""
        self.ids.extend(new_token_ids)
        self.num_generated += len(new_token_ids)
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset :])
        is_waiting = new_text.endswith(REPLACEMENT_CHAR) and not new_text.endswith(INVALID_RUN)
        if len(new_text) <= len(prefix_text) or is_waiting:
            return ""  # nothing new, or a character still waits for its last bytes
        delta = new_text[len(prefix_text) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self._drop_old_ids()
        return delta

    def flush(self) -> str:
        """Return whatever is still held back (an incomplete character becomes U+FFFD)."""
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset :])
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self._drop_old_ids()
        return new_text[len(prefix_text) :]

    def _drop_old_ids(self) -> None:
        """Forget ids before the context window so that state stays small on long outputs."""
        if self.prefix_offset:
            del self.ids[: self.prefix_offset]
            self.read_offset -= self.prefix_offset
            self.prefix_offset = 0

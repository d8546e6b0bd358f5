"""Generation requests as the router's core sees them, and their validation (pure).

Both public APIs (conveyor.v1.Generation and KServe v2) convert their messages into a
`GenerateInput`; `prepare()` validates every field, tokenizes (chat template for chats) and
returns a `PreparedRequest` ready for the scheduler. Every error is an `InvalidRequest`
whose message names the field, the value and what is allowed. The cheap bounds come first
and the prompt's size is checked before the tokenizer runs; token ids, given or tokenized,
must fit the model's embedding rows (config.json `vocab_size`).
"""

from __future__ import annotations

import secrets
import uuid
from dataclasses import dataclass, field

from services.common.errors import InvalidRequest, PromptTooLong
from services.common.limits import (
    RequestLimits,
    check_request,
    check_request_id,
    check_token_ids,
    clip,
)
from services.common.sampling import SamplingParams
from services.router.tokenizer import Tokenizer

CHAT_ROLES = ("system", "user", "assistant", "tool")


@dataclass(slots=True)
class ChatTurn:
    """One message of a chat."""

    role: str
    content: str


@dataclass(slots=True)
class ModelLimits:
    """What the router serves: the model's name, context length and embedding rows, and
    request limits (RouterConfig documents each)."""

    name: str
    max_model_len: int
    vocab_size: int
    """The model's embedding rows (config.json): every token id must be below it."""
    max_stop_strings: int = 16
    max_stop_string_chars: int = 256
    max_prompt_bytes: int = 1 << 20
    max_json_bytes: int = 64 << 10
    max_json_depth: int = 16
    max_stream_requests: int = 64
    request: RequestLimits = field(default_factory=RequestLimits)


@dataclass(slots=True)
class GenerateInput:
    """A generation request from either public API, before validation.

    Exactly one of text, token_ids and chat is set.
    """

    sampling: SamplingParams
    text: str | None = None
    token_ids: list[int] | None = None
    chat: list[ChatTurn] | None = None
    stop: list[str] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    priority: int = 0
    tenant: str = ""
    request_id: str = ""
    model: str = ""


@dataclass(slots=True)
class PreparedRequest:
    """A validated, tokenized request, ready to submit to the scheduler."""

    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    stop: list[str] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    priority: int = 0
    tenant: str = ""
    prompt_text: str = ""  # the rendered prompt (KServe echoes it unless excluded)
    principal: str = ""  # whom it belongs to: request_id lives in its namespace
    owner_token: str = field(default_factory=lambda: secrets.token_hex(16), repr=False)
    """Random per submission: only this router's Resume and Abort act on the request."""


def check_model(model: str, limits: ModelLimits) -> None:
    """Raises InvalidRequest unless `model` is empty or the served model's name."""
    if model and model != limits.name:
        raise InvalidRequest(
            f"model={clip(model)} is not served here: the served model is "
            f"{limits.name!r} (or leave model empty)"
        )


def tokenize_prompt(
    req: GenerateInput, tokenizer: Tokenizer, limits: ModelLimits
) -> tuple[list[int], str]:
    """(prompt ids, prompt text) of a text, token-id or chat prompt; validates the prompt,
    its size before the tokenizer runs. Slow for a long prompt: call it off the event loop."""
    prompts = [p for p in (req.text, req.token_ids, req.chat) if p is not None]
    if len(prompts) != 1:
        raise InvalidRequest("prompt is missing: set exactly one of text, token_ids or chat")
    if req.token_ids is not None:
        ids = _check_token_ids(req.token_ids, limits)
        return ids, tokenizer.decode(ids)
    _check_prompt_bytes(req, limits)
    if req.text is not None:
        if not req.text:
            raise InvalidRequest("text is empty: the prompt needs at least one character")
        return tokenizer.encode(req.text), req.text
    messages = _check_chat(req.chat)
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return tokenizer.encode(rendered, add_special_tokens=False), rendered


def _check_prompt_bytes(req: GenerateInput, limits: ModelLimits) -> None:
    """A text or chat prompt's UTF-8 size against --max-prompt-bytes (before tokenizing)."""
    if req.text is not None:
        # a character is 1 to 4 bytes: skip the encoding when the length alone decides
        size = len(req.text) if len(req.text) > limits.max_prompt_bytes else _utf8_len(req.text)
        what = "text"
    else:
        size = sum(_utf8_len(t.role) + _utf8_len(t.content) for t in req.chat or ())
        what = "chat (roles and contents)"
    if size > limits.max_prompt_bytes:
        raise InvalidRequest(
            f"{what} has at least {size} bytes, too long: at most {limits.max_prompt_bytes} "
            "bytes (--max-prompt-bytes)"
        )


def _utf8_len(text: str) -> int:
    return len(text.encode("utf-8", errors="surrogatepass"))


def _check_token_ids(ids: list[int], limits: ModelLimits) -> list[int]:
    if not ids:
        raise InvalidRequest("token_ids is empty: the prompt needs at least one token")
    _check_prompt_len(len(ids), limits)  # before the ids are decoded
    check_token_ids("token_ids", ids, limits.vocab_size)
    return list(ids)


def _check_prompt_len(num_prompt: int, limits: ModelLimits) -> None:
    if num_prompt >= limits.max_model_len:
        raise PromptTooLong(
            f"prompt has {num_prompt} tokens, too long: the model's context "
            f"length is {limits.max_model_len} (prompt + max_tokens)"
        )


def _check_chat(chat: list[ChatTurn]) -> list[dict]:
    if not chat:
        raise InvalidRequest("chat.messages is empty: a chat needs at least one message")
    for index, turn in enumerate(chat):
        if turn.role not in CHAT_ROLES:
            raise InvalidRequest(
                f"chat.messages[{index}].role={clip(turn.role)} is not allowed: "
                f"must be one of {', '.join(CHAT_ROLES)}"
            )
    return [{"role": t.role, "content": t.content} for t in chat]


def _check_stop(stop: list[str], limits: ModelLimits) -> None:
    if len(stop) > limits.max_stop_strings:
        raise InvalidRequest(
            f"stop has {len(stop)} strings, too many: at most {limits.max_stop_strings} "
            "(--max-stop-strings)"
        )
    for index, text in enumerate(stop):
        if not text:
            raise InvalidRequest(f"stop[{index}] is empty: stop strings need >= 1 character")
        if len(text) > limits.max_stop_string_chars:
            raise InvalidRequest(
                f"stop[{index}] has {len(text)} characters, too long: at most "
                f"{limits.max_stop_string_chars} (--max-stop-string-chars)"
            )


def prepare(req: GenerateInput, tokenizer: Tokenizer, limits: ModelLimits) -> PreparedRequest:
    """Validates and tokenizes a request.

    Raises:
        InvalidRequest: a field is out of range (the message names it).
        PromptTooLong: prompt plus max_tokens exceed the model's context length.
    """
    check_model(req.model, limits)
    if req.request_id:
        check_request_id(req.request_id)
    check_request(req.sampling, req.priority, req.tenant, limits.request, limits.vocab_size)
    _check_stop(req.stop, limits)
    prompt_ids, prompt_text = tokenize_prompt(req, tokenizer, limits)
    if req.token_ids is None:  # a tokenizer may know more ids than the model has rows
        check_token_ids("prompt", prompt_ids, limits.vocab_size)
    num_prompt, max_tokens = len(prompt_ids), req.sampling.max_tokens
    _check_prompt_len(num_prompt, limits)
    if num_prompt + max_tokens > limits.max_model_len:
        raise PromptTooLong(
            f"prompt ({num_prompt} tokens) + max_tokens ({max_tokens}) = "
            f"{num_prompt + max_tokens} exceeds the model's context length "
            f"{limits.max_model_len}: lower max_tokens to at most "
            f"{limits.max_model_len - num_prompt} or shorten the prompt"
        )
    return PreparedRequest(
        request_id=req.request_id or uuid.uuid4().hex,
        prompt_ids=prompt_ids,
        sampling=req.sampling,
        stop=list(req.stop),
        include_stop_str_in_output=req.include_stop_str_in_output,
        priority=req.priority,
        tenant=req.tenant,
        prompt_text=prompt_text,
    )

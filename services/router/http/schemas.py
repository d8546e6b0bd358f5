"""OpenAI's request and response bodies as pydantic models (the fields Conveyor serves).

Requests keep unknown fields (`extra="allow"`) so that `unsupported_fields()` can name each
one in a 400 instead of silently ignoring it; a field sent as null counts as not sent, as
OpenAI's own server treats it. Ranges are checked by the core (SamplingParams, limits), whose
messages already name the field and the allowed range.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

from services.common.limits import lone_surrogate_at


class _Unicode(BaseModel):
    """A request body whose every string is valid Unicode (a 400 naming the field, not a
    500 from the tokenizer: JSON's `\\ud800` escapes decode to lone surrogates), and whose
    every value has its field's JSON type: `"max_tokens": true` or `"5"` is refused, not
    read as 1 or 5 (`strict`; an integer still fits a float field)."""

    model_config = ConfigDict(strict=True)

    @model_validator(mode="before")
    @classmethod
    def _no_lone_surrogates(cls, data):
        where = lone_surrogate_at(data)
        if where is not None:
            raise PydanticCustomError(
                "invalid_unicode",
                "{where} is not valid Unicode: it holds a lone surrogate (an unpaired "
                "\\ud800-\\udfff escape); send text that UTF-8 can encode",
                {"where": where},
            )
        return data


class _Request(_Unicode):
    model_config = ConfigDict(extra="allow", strict=True)

    def unsupported_fields(self) -> list[str]:
        """Fields this server does not know, sent with a value other than null."""
        return sorted(k for k, v in (self.model_extra or {}).items() if v is not None)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    include_usage: bool = False
    """A last chunk with `choices: []` and the usage of the whole request."""


class SamplingFields(_Request):
    """Fields both generation endpoints share (OpenAI's, then vLLM's extras)."""

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    n: int = Field(default=1, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    user: str | None = None  # accepted and ignored, as a tag the caller keeps
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    # Conveyor's scheduling fields (as in conveyor.v1.GenerateRequest; an API key sets both)
    priority: int = 0
    tenant: str = ""


class CompletionRequest(SamplingFields):
    """POST /v1/completions."""

    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0)
    best_of: int | None = None


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True)

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One message of `messages`: text content, or text parts (other parts are refused)."""

    model_config = ConfigDict(extra="allow", strict=True)

    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage]
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0)


# -- responses ----------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    """Legacy completions' logprobs: parallel lists, one entry per output token."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float] = Field(default_factory=list)
    top_logprobs: list[dict[str, float]] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    """The body of a completion, and of each of its stream chunks (same object name)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    system_fingerprint: str | None = None
    """The weights that sampled the text: `fingerprint(weight_version)`."""
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[ChatChoice]
    usage: UsageInfo


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


class TokenizeRequest(_Unicode):
    """POST /tokenize (vLLM's): a text's token ids, as the served model's tokenizer gives."""

    model_config = ConfigDict(extra="forbid", strict=True)

    prompt: str
    model: str | None = None


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "conveyor"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error body: {"error": {"message", "type", "param", "code"}}."""

    error: ErrorInfo

"""The two response shapes of generation: completions and chat completions.

A shape turns each choice's outputs into stream chunks (as they come) or into the whole
response (at the end). The endpoints (services/router/http/endpoints.py) run the choices
and stay the same for both.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from pydantic import BaseModel

from services.router.http import schemas
from services.router.http.convert import ChoiceLogprobs, usage_of
from services.router.output import OutputDelta
from services.router.request import PreparedRequest
from services.router.tokenizer import Tokenizer


def fingerprint(weight_version: int) -> str:
    """OpenAI's `system_fingerprint` ("the backend configuration the model runs with"):
    here the version of the weights that sampled the tokens (0: as loaded from --model;
    UpdateWeights bumps it, docs/training.md)."""
    return f"weights-v{weight_version}"


def joined(outs: list[OutputDelta]) -> OutputDelta:
    """A choice's outputs as one (the last one's finish reason and usage, the newest
    weight version)."""
    return OutputDelta(
        text="".join(o.text for o in outs),
        token_ids=[t for o in outs for t in o.token_ids],
        offset=0,
        logprobs=[lp for o in outs for lp in o.logprobs],
        finish_reason=outs[-1].finish_reason,
        usage=outs[-1].usage,
        weight_version=max(o.weight_version for o in outs),
        text_lengths=[n for o in outs for n in o.text_lengths],
    )


@dataclass
class Shape:
    """What both shapes share: ids, the model's name, logprobs state per choice."""

    model: str
    tokenizer: Tokenizer
    prepared: list[PreparedRequest]
    n: int
    wants_logprobs: bool
    created: int = field(default_factory=lambda: int(time.time()))
    id: str = ""
    logprobs: list[ChoiceLogprobs] = field(init=False)
    lasts: list[OutputDelta | None] = field(init=False)
    weight_version: int = field(default=0, init=False)
    """The newest weight version seen in any choice (the response's and usage chunk's)."""

    def __post_init__(self) -> None:
        self.logprobs = [ChoiceLogprobs(self.tokenizer) for _ in self.prepared]
        self.lasts = [None] * len(self.prepared)

    def seen(self, index: int, out: OutputDelta) -> None:
        self.weight_version = max(self.weight_version, out.weight_version)
        if out.finish_reason is not None:
            self.lasts[index] = out

    def is_empty(self, out: OutputDelta) -> bool:
        """Nothing to tell (the detokenizer holds back a character cut between tokens)."""
        return not out.text and out.finish_reason is None and not self.wants_logprobs

    def usage(self) -> schemas.UsageInfo:
        return usage_of(self.lasts, self.n)

    def chunk(self, index: int, out: OutputDelta) -> list[BaseModel]:
        raise NotImplementedError

    def usage_chunk(self) -> BaseModel:
        raise NotImplementedError

    def response(self, outs: list[list[OutputDelta]]) -> BaseModel:
        raise NotImplementedError


@dataclass
class CompletionShape(Shape):
    """/v1/completions: `text_completion` objects, chunks included."""

    echo: bool = False
    _started: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        super().__post_init__()
        self.id = f"cmpl-{uuid.uuid4().hex}"
        if self.echo:  # offsets of output tokens count from the end of the echoed prompt
            for lp, req in zip(self.logprobs, self.prepared, strict=True):
                lp.text_offset = len(req.prompt_text)

    def _choice(self, index: int, out: OutputDelta) -> schemas.CompletionChoice:
        text = out.text
        if self.echo and index not in self._started:
            text = self.prepared[index].prompt_text + text
        self._started.add(index)
        lp = self.logprobs[index].completion(out) if self.wants_logprobs else None
        return schemas.CompletionChoice(
            index=index, text=text, logprobs=lp, finish_reason=out.finish_reason
        )

    def _body(self, choices, usage=None, weight_version=None) -> schemas.CompletionResponse:
        version = self.weight_version if weight_version is None else weight_version
        return schemas.CompletionResponse(
            id=self.id,
            created=self.created,
            model=self.model,
            system_fingerprint=fingerprint(version),
            choices=choices,
            usage=usage,
        )

    def chunk(self, index: int, out: OutputDelta) -> list[BaseModel]:
        self.seen(index, out)
        if self.is_empty(out) and not (self.echo and index not in self._started):
            return []
        return [self._body([self._choice(index, out)], weight_version=out.weight_version)]

    def usage_chunk(self) -> BaseModel:
        return self._body([], self.usage())

    def response(self, outs: list[list[OutputDelta]]) -> BaseModel:
        choices = []
        for index, choice_outs in enumerate(outs):
            out = joined(choice_outs)
            self.seen(index, out)
            choices.append(self._choice(index, out))
        return self._body(choices, self.usage())


@dataclass
class ChatShape(Shape):
    """/v1/chat/completions: `chat.completion` and `chat.completion.chunk` objects."""

    _started: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        super().__post_init__()
        self.id = f"chatcmpl-{uuid.uuid4().hex}"

    def _chunk(self, choices, usage=None, weight_version=None) -> schemas.ChatCompletionChunk:
        version = self.weight_version if weight_version is None else weight_version
        return schemas.ChatCompletionChunk(
            id=self.id,
            created=self.created,
            model=self.model,
            system_fingerprint=fingerprint(version),
            choices=choices,
            usage=usage,
        )

    def chunk(self, index: int, out: OutputDelta) -> list[BaseModel]:
        """The choice's first chunk announces the role (as OpenAI's do), the rest carry
        content; the last one has the finish reason."""
        self.seen(index, out)
        chunks = []
        if index not in self._started:
            self._started.add(index)
            role = schemas.ChatDelta(role="assistant", content="")
            role_choice = schemas.ChatChunkChoice(index=index, delta=role)
            chunks.append(self._chunk([role_choice], weight_version=out.weight_version))
        lp = self.logprobs[index].chat(out) if self.wants_logprobs else None
        choice = schemas.ChatChunkChoice(
            index=index,
            delta=schemas.ChatDelta(content=out.text),
            logprobs=lp,
            finish_reason=out.finish_reason,
        )
        if not self.is_empty(out):
            chunks.append(self._chunk([choice], weight_version=out.weight_version))
        return chunks

    def usage_chunk(self) -> BaseModel:
        return self._chunk([], self.usage())

    def response(self, outs: list[list[OutputDelta]]) -> BaseModel:
        choices = []
        for index, choice_outs in enumerate(outs):
            out = joined(choice_outs)
            self.seen(index, out)
            lp = self.logprobs[index].chat(out) if self.wants_logprobs else None
            choices.append(
                schemas.ChatChoice(
                    index=index,
                    message=schemas.AssistantMessage(content=out.text),
                    logprobs=lp,
                    finish_reason=out.finish_reason,
                )
            )
        return schemas.ChatCompletionResponse(
            id=self.id,
            created=self.created,
            model=self.model,
            system_fingerprint=fingerprint(self.weight_version),
            choices=choices,
            usage=self.usage(),
        )

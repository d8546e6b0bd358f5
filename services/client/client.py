"""A small client of conveyor.v1.Generation.

    with ConveyorClient("localhost:50051") as client:
        for delta in client.generate(prompt="Once upon a time", max_tokens=32):
            print(delta.text, end="", flush=True)
        result = client.complete(chat=[{"role": "user", "content": "Hi"}], max_tokens=16)

Sampling keywords keep vLLM's names (temperature, top_p, top_k, min_p, seed, max_tokens,
stop_token_ids, ignore_eos, logprobs, repetition_penalty, presence_penalty,
frequency_penalty); `stop`, `include_stop_str_in_output`, `priority`, `tenant`,
`request_id` and `model` are request fields. Errors are `grpc.RpcError`s whose code and
details say what to fix.

A router with API keys or TLS takes them as keywords:

    ConveyorClient("router:50051", api_key=os.environ["CONVEYOR_API_KEY"], tls_ca="ca.crt")

(`tls_cert` / `tls_key` add a client certificate, for a router with --tls-client-ca).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

from services.common.pb import FINISH_FROM_PB
from services.common.proto.conveyor.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from services.common.security import ClientSecurity

_SAMPLING_FIELDS = set(common_pb2.SamplingParams.DESCRIPTOR.fields_by_name)
_REQUEST_FIELDS = {
    "stop",
    "include_stop_str_in_output",
    "priority",
    "tenant",
    "request_id",
    "model",
}


@dataclass(slots=True)
class Delta:
    """One streamed piece of output."""

    request_id: str
    text: str
    token_ids: list[int]
    offset: int
    finish_reason: str | None = None  # "stop", "length", "abort" on the last delta
    usage: dict[str, int] | None = None  # prompt_tokens, completion_tokens, cached_tokens
    logprobs: list[Any] = field(default_factory=list)
    weight_version: int = 0  # the model weights that produced these tokens (docs/training.md)


@dataclass(slots=True)
class Result:
    """A whole generation."""

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str | None
    usage: dict[str, int]

    def to_dict(self) -> dict[str, Any]:
        return {
            "request_id": self.request_id,
            "text": self.text,
            "token_ids": self.token_ids,
            "finish_reason": self.finish_reason,
            "usage": self.usage,
        }


def build_request(
    prompt: str | None = None,
    chat: list[dict] | None = None,
    token_ids: list[int] | None = None,
    **kwargs: Any,
) -> generation_pb2.GenerateRequest:
    """A GenerateRequest from a prompt (one of prompt, chat, token_ids) and keywords."""
    if sum(p is not None for p in (prompt, chat, token_ids)) != 1:
        raise ValueError("give exactly one of prompt, chat or token_ids")
    unknown = set(kwargs) - _SAMPLING_FIELDS - _REQUEST_FIELDS
    if unknown:
        raise TypeError(f"unknown generate() arguments: {', '.join(sorted(unknown))}")
    sampling = {k: v for k, v in kwargs.items() if k in _SAMPLING_FIELDS and v is not None}
    fields = {k: v for k, v in kwargs.items() if k in _REQUEST_FIELDS and v is not None}
    if isinstance(fields.get("stop"), str):
        fields["stop"] = [fields["stop"]]
    msg = generation_pb2.GenerateRequest(sampling=common_pb2.SamplingParams(**sampling), **fields)
    if prompt is not None:
        msg.text = prompt
    elif token_ids is not None:
        msg.token_ids.ids.extend(token_ids)
    else:
        msg.chat.messages.extend(
            generation_pb2.ChatMessage(role=m["role"], content=m["content"]) for m in chat
        )
    return msg


def delta_from_pb(msg: generation_pb2.GenerateResponse) -> Delta:
    usage = None
    if msg.HasField("usage"):
        usage = {
            "prompt_tokens": msg.usage.prompt_tokens,
            "completion_tokens": msg.usage.completion_tokens,
            "cached_tokens": msg.usage.cached_tokens,
        }
    return Delta(
        request_id=msg.request_id,
        text=msg.text,
        token_ids=list(msg.token_ids),
        offset=msg.offset,
        finish_reason=FINISH_FROM_PB.get(msg.finish_reason),
        usage=usage,
        logprobs=list(msg.logprobs),
        weight_version=msg.weight_version,
    )


def collect(deltas) -> Result:
    """Joins deltas into a Result."""
    texts, ids, last = [], [], None
    for delta in deltas:
        texts.append(delta.text)
        ids.extend(delta.token_ids)
        last = delta
    if last is None:
        raise RuntimeError("the server closed the stream without a response")
    return Result(
        request_id=last.request_id,
        text="".join(texts),
        token_ids=ids,
        finish_reason=last.finish_reason,
        usage=last.usage or {},
    )


def _security(api_key, tls_ca, tls_cert, tls_key) -> ClientSecurity:
    return ClientSecurity.from_files(tls_ca, tls_cert, tls_key, token=api_key)


class ConveyorClient:
    """Blocking client; `generate()` yields Deltas, `complete()` returns a Result.

    Args:
        api_key: sent as `authorization: Bearer <key>` (a router with --api-key-file).
        tls_ca: PEM file of the CA the router's certificate chains to: TLS on.
        tls_cert, tls_key: a client certificate (a router with --tls-client-ca).
    """

    def __init__(
        self,
        address: str = "localhost:50051",
        timeout_s: float | None = None,
        *,
        api_key: str | None = None,
        tls_ca: str | None = None,
        tls_cert: str | None = None,
        tls_key: str | None = None,
    ):
        self.timeout_s = timeout_s
        security = _security(api_key, tls_ca, tls_cert, tls_key)
        self._metadata = security.with_metadata(None)
        self._channel = security.sync_channel(address)
        self._stub = generation_pb2_grpc.GenerationStub(self._channel)

    def __enter__(self) -> ConveyorClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    def generate(
        self,
        prompt: str | None = None,
        *,
        chat: list[dict] | None = None,
        token_ids: list[int] | None = None,
        **kwargs: Any,
    ) -> Iterator[Delta]:
        """Streams the output; closing the iterator early cancels the request."""
        return self._stream(self._stub.Generate, build_request(prompt, chat, token_ids, **kwargs))

    def resume(self, request_id: str, offset: int) -> Iterator[Delta]:
        """Streams a request's output from token `offset` on (the tokens already received),
        through any router: a Generate stream whose router died goes on here."""
        request = generation_pb2.ResumeGenerationRequest(request_id=request_id, offset=offset)
        return self._stream(self._stub.Resume, request)

    def _stream(self, rpc, request) -> Iterator[Delta]:
        call = rpc(request, timeout=self.timeout_s, metadata=self._metadata)
        try:
            for msg in call:
                yield delta_from_pb(msg)
        finally:
            call.cancel()

    def complete(self, prompt: str | None = None, **kwargs: Any) -> Result:
        """The whole output at once."""
        return collect(self.generate(prompt, **kwargs))

    def tokenize(self, text: str | None = None, chat: list[dict] | None = None) -> list[int]:
        msg = _tokenize_request(text, chat)
        reply = self._stub.Tokenize(msg, timeout=self.timeout_s, metadata=self._metadata)
        return list(reply.token_ids)

    def list_models(self) -> list[dict[str, Any]]:
        reply = self._stub.ListModels(
            generation_pb2.ListModelsRequest(), timeout=self.timeout_s, metadata=self._metadata
        )
        return [{"name": m.name, "max_model_len": m.max_model_len} for m in reply.models]


def _tokenize_request(text: str | None, chat: list[dict] | None) -> generation_pb2.TokenizeRequest:
    msg = generation_pb2.TokenizeRequest()
    if chat is not None:
        msg.chat.messages.extend(generation_pb2.ChatMessage(**m) for m in chat)
    else:
        msg.text = text or ""
    return msg


class AsyncConveyorClient:
    """asyncio client with the same methods (and credentials) as ConveyorClient, awaited."""

    def __init__(
        self,
        address: str = "localhost:50051",
        timeout_s: float | None = None,
        *,
        api_key: str | None = None,
        tls_ca: str | None = None,
        tls_cert: str | None = None,
        tls_key: str | None = None,
    ):
        self.timeout_s = timeout_s
        security = _security(api_key, tls_ca, tls_cert, tls_key)
        self._metadata = security.with_metadata(None)
        self._channel = security.channel(address)
        self._stub = generation_pb2_grpc.GenerationStub(self._channel)

    async def __aenter__(self) -> AsyncConveyorClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close()

    async def generate(
        self,
        prompt: str | None = None,
        *,
        chat: list[dict] | None = None,
        token_ids: list[int] | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[Delta]:
        """Streams the output; leaving the loop early cancels the request."""
        call = self._stub.Generate(
            build_request(prompt, chat, token_ids, **kwargs),
            timeout=self.timeout_s,
            metadata=self._metadata,
        )
        try:
            async for msg in call:
                yield delta_from_pb(msg)
        finally:
            call.cancel()

    async def resume(self, request_id: str, offset: int) -> AsyncIterator[Delta]:
        """Streams a request's output from token `offset` on, as ConveyorClient.resume."""
        call = self._stub.Resume(
            generation_pb2.ResumeGenerationRequest(request_id=request_id, offset=offset),
            timeout=self.timeout_s,
            metadata=self._metadata,
        )
        try:
            async for msg in call:
                yield delta_from_pb(msg)
        finally:
            call.cancel()

    async def complete(self, prompt: str | None = None, **kwargs: Any) -> Result:
        return collect([d async for d in self.generate(prompt, **kwargs)])

    async def tokenize(self, text: str | None = None, chat: list[dict] | None = None) -> list[int]:
        msg = _tokenize_request(text, chat)
        reply = await self._stub.Tokenize(msg, timeout=self.timeout_s, metadata=self._metadata)
        return list(reply.token_ids)

    async def list_models(self) -> list[dict[str, Any]]:
        reply = await self._stub.ListModels(
            generation_pb2.ListModelsRequest(), timeout=self.timeout_s, metadata=self._metadata
        )
        return [{"name": m.name, "max_model_len": m.max_model_len} for m in reply.models]

"""`conveyor bench --backend openai`: the same workload through the router's OpenAI-compatible
HTTP API, with the official `openai` client (what most serving benchmarks use).

Each request is a streamed `/v1/completions` with token-id prompts, greedy, asking for the
usage in a last chunk. A chunk is one text delta: its arrival time is a token time; a
character the detokenizer held back arrives with the next chunk, so the usage's
`completion_tokens` is the request's output length (as vLLM's benchmark counts it).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Callable

from services.bench.datasets import WORDS, BenchRequest
from services.bench.metrics import RequestOutput
from services.common.errors import ConfigError
from services.common.security import ClientSecurity

Send = Callable[[BenchRequest], Awaitable[RequestOutput]]


def _check_plaintext(security: ClientSecurity) -> None:
    if security.is_tls:
        raise ConfigError("--backend openai speaks plain HTTP: drop --tls-ca (or use grpc)")


def _headers(security: ClientSecurity) -> dict[str, str]:
    headers = {"content-type": "application/json"}
    if security.token:
        headers["authorization"] = f"Bearer {security.token}"
    return headers


async def openai_token_pool(
    address: str, text: str = WORDS, security: ClientSecurity | None = None
) -> list[int]:
    """The distinct ids the served tokenizer gives `text` (POST /tokenize)."""
    return sorted(set(await openai_tokenize(address, text, security)))


async def openai_tokenize(
    address: str, text: str, security: ClientSecurity | None = None
) -> list[int]:
    """The ids the served tokenizer gives `text`, in order (POST /tokenize)."""
    security = security or ClientSecurity()
    _check_plaintext(security)
    request = urllib.request.Request(
        f"http://{address}/tokenize",
        data=json.dumps({"prompt": text}).encode(),
        headers=_headers(security),
    )

    def post() -> dict:
        with urllib.request.urlopen(request, timeout=30) as response:
            return json.loads(response.read())

    return list((await asyncio.to_thread(post))["tokens"])


@contextlib.asynccontextmanager
async def openai_sender(address: str, options) -> AsyncIterator[Send]:
    """A function sending one request over HTTP (one client: pooled connections)."""
    import openai

    _check_plaintext(options.security)
    client = openai.AsyncOpenAI(
        base_url=f"http://{address}/v1",
        api_key=options.security.token or "EMPTY",
        max_retries=0,
        timeout=options.timeout_s,
    )
    try:
        model = (await client.models.list()).data[0].id
        yield lambda request: _one(client, model, request, options)
    finally:
        await client.close()


async def _one(client, model: str, request: BenchRequest, options) -> RequestOutput:
    import openai

    out = RequestOutput(prompt_len=len(request.prompt_ids))
    start = out.sent_at = time.perf_counter()
    num_tokens = None
    try:
        stream = await client.completions.create(
            model=model,
            prompt=request.prompt_ids,
            max_tokens=request.output_len,
            temperature=options.temperature,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": options.ignore_eos},
        )
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].text:
                out.add_tokens(time.perf_counter() - start, 1)
            if chunk.usage is not None:
                num_tokens = chunk.usage.completion_tokens
                details = chunk.usage.prompt_tokens_details
                out.cached_tokens = (details.cached_tokens or 0) if details else 0
        out.output_len = max(out.output_len, num_tokens or 0)
        out.success = out.output_len > 0
        if not out.success:
            out.error = "the stream ended without a token"
    except openai.APIError as exc:
        out.error = f"{type(exc).__name__}: {exc}"
    return out

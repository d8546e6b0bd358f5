"""Sends a workload to a router over conveyor.v1.Generation (or, with backend "openai", its
OpenAI-compatible HTTP API: services/bench/openai_driver.py) and times every streamed token.

Requests start at Poisson times (or all at once), at most `max_concurrency` in flight, each
greedy with `max_tokens = output_len`. One gRPC channel (one HTTP client) carries every stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from dataclasses import dataclass, field

import grpc

from services.bench.datasets import WORDS, BenchRequest
from services.bench.metrics import RequestOutput
from services.bench.stats import SchedulerGate
from services.common.errors import ConfigError
from services.common.security import ClientSecurity

logger = logging.getLogger(__name__)

_CHANNEL_OPTIONS = [("grpc.max_receive_message_length", 64 << 20)]
BACKENDS = ("grpc", "openai")


@dataclass(slots=True)
class DriverOptions:
    """How requests are sent."""

    request_rate: float = float("inf")
    """Requests per second (Poisson); inf sends every request at once."""
    max_concurrency: int | None = None
    """At most this many requests in flight; None means no limit."""
    ignore_eos: bool = True
    timeout_s: float | None = None
    """Per-request deadline; None means none."""
    progress: bool = True
    security: ClientSecurity = field(default_factory=ClientSecurity)
    """TLS to the router and the API key every request presents."""
    backend: str = "grpc"
    """"grpc": conveyor.v1.Generation; "openai": the HTTP API's /v1/completions."""
    temperature: float = 0.0
    """Sampling temperature of every request (0: greedy)."""

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ConfigError(f"--backend={self.backend!r}: must be one of {', '.join(BACKENDS)}")
        if not 0.0 <= self.temperature <= 2.0:
            raise ConfigError(f"--temperature={self.temperature}: must be in [0, 2]")


async def token_pool(
    address: str, text: str = WORDS, security: ClientSecurity | None = None, backend: str = "grpc"
) -> list[int]:
    """The distinct ids the served tokenizer gives `text`: valid prompt ids for any model."""
    return sorted(set(await tokenize(address, text, security, backend)))


async def tokenize(
    address: str, text: str, security: ClientSecurity | None = None, backend: str = "grpc"
) -> list[int]:
    """The ids the served tokenizer gives `text`, in order."""
    from services.common.proto.conveyor.v1 import generation_pb2, generation_pb2_grpc

    if backend == "openai":
        from services.bench.openai_driver import openai_tokenize

        return await openai_tokenize(address, text, security)
    security = security or ClientSecurity()
    async with security.channel(address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        reply = await stub.Tokenize(
            generation_pb2.TokenizeRequest(text=text),
            timeout=30,
            metadata=security.with_metadata(None),
        )
    return list(reply.token_ids)


async def _one(stub, request: BenchRequest, options: DriverOptions) -> RequestOutput:
    from services.client.client import build_request

    out = RequestOutput(prompt_len=len(request.prompt_ids))
    msg = build_request(
        token_ids=request.prompt_ids,
        max_tokens=request.output_len,
        temperature=options.temperature,
        ignore_eos=options.ignore_eos,
    )
    start = out.sent_at = time.perf_counter()
    try:
        metadata = options.security.with_metadata(None)
        async for reply in stub.Generate(msg, timeout=options.timeout_s, metadata=metadata):
            out.add_tokens(time.perf_counter() - start, len(reply.token_ids))
            if reply.HasField("usage"):
                out.cached_tokens = reply.usage.cached_tokens
        out.success = out.output_len > 0
        if not out.success:
            out.error = "the stream ended without a token"
    except grpc.aio.AioRpcError as exc:
        out.error = f"{exc.code().name}: {exc.details()}"
    return out


async def run_requests(
    address: str,
    requests: list[BenchRequest],
    gaps_s: list[float],
    options: DriverOptions,
    gate: SchedulerGate | None = None,
) -> tuple[list[RequestOutput], float]:
    """Sends every request (request i after gaps_s[0..i-1]); returns the outputs, in request
    order, and the wall time from the first send to the last response.

    With a `gate` (a burst): the scheduler is paused before the first send and unpaused
    once every request waits in its queue; the run, and every request's times, count from
    that release."""
    limit = asyncio.Semaphore(options.max_concurrency or len(requests) or 1)
    bar = _progress_bar(len(requests), options.progress)

    async def limited(request: BenchRequest) -> RequestOutput:
        async with limit:
            out = await send(request)
        if not out.success:
            logger.warning("request failed: %s", out.error)
        bar.update(1)
        return out

    async with _sender(address, options) as send:
        if gate is not None:
            await gate.hold()
        tasks = []
        try:
            start = time.perf_counter()
            send_at = itertools.accumulate([0.0, *gaps_s[:-1]])
            for request, at in zip(requests, send_at, strict=False):
                delay = at - (time.perf_counter() - start)
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(limited(request)))
            if gate is not None:
                await gate.wait_queued(len(requests), lambda: sum(t.done() for t in tasks))
                if any(t.done() and t.result().success for t in tasks):
                    raise ConfigError(
                        f"requests completed while the scheduler at {gate.address} held the "
                        "burst: the router sent them to another pipeline; --release-at-once "
                        "needs one pipeline behind the router"
                    )
                await gate.release()
                start = gate.released_at
            outputs = await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
            bar.close()
            if gate is not None:
                await gate.release()
        duration = time.perf_counter() - start
    if gate is not None:
        for out in outputs:
            out.count_from(start)
    return list(outputs), duration


@contextlib.asynccontextmanager
async def _sender(address: str, options: DriverOptions):
    """A function sending one request to the router over the options' backend."""
    if options.backend == "openai":
        from services.bench.openai_driver import openai_sender

        async with openai_sender(address, options) as send:
            yield send
        return
    from services.common.proto.conveyor.v1 import generation_pb2_grpc

    async with options.security.channel(address, options=_CHANNEL_OPTIONS) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        yield lambda request: _one(stub, request, options)


def _progress_bar(total: int, enabled: bool):
    if not enabled:
        return _NoBar()
    from tqdm import tqdm

    return tqdm(total=total, desc="requests", unit="req", leave=False)


class _NoBar(contextlib.AbstractContextManager):
    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass

    def __exit__(self, *exc) -> None:
        return None

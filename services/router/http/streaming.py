"""Running a request's choices together, and stopping them when the client goes away.

Every choice is one `RouterCore.generate` stream; cancelling the task that iterates it runs
the stream's `finally`, which aborts the request in the scheduler (its KV blocks are freed
within a step). So every way out of here (a client disconnect, an error in one choice, the
server stopping) cancels every choice still running.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from typing import TypeVar

from pydantic import BaseModel
from starlette.requests import Request

from services.router.output import OutputDelta

T = TypeVar("T")

DONE_EVENT = b"data: [DONE]\n\n"


class ClientGone(Exception):
    """The client closed the connection before the response was ready."""


def sse_event(body: BaseModel, exclude: set[str] | None = None) -> bytes:
    """One server-sent event holding `body` as JSON."""
    return b"data: " + body.model_dump_json(exclude=exclude).encode() + b"\n\n"


async def merge(
    streams: list[AsyncIterator[OutputDelta]],
) -> AsyncIterator[tuple[int, OutputDelta]]:
    """(choice index, output) of every stream as they come; the first error is raised, and
    leaving early (or an error) cancels every stream still running."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[OutputDelta]) -> None:
        try:
            async for out in stream:
                await queue.put((index, out, None))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer, who raises it
            await queue.put((index, None, exc))
            return
        await queue.put((index, None, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        num_running = len(tasks)
        while num_running:
            index, out, error = await queue.get()
            if error is not None:
                raise error
            if out is None:
                num_running -= 1
                continue
            yield index, out
    finally:
        for task in tasks:
            task.cancel()


async def gather_all(coros: list[Awaitable[T]]) -> list[T]:
    """Results of all `coros`; the first error cancels the others."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """The result of `work`, which is cancelled (ClientGone raised) if the client disconnects
    first. For work before the response starts: Starlette cancels a streaming response's
    body itself when the client goes."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task not in done:
        task.cancel()
        await asyncio.wait({task})  # its aborts are on their way before the handler ends
        raise ClientGone("the client disconnected")
    return task.result()

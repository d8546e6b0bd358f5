"""A worker's one-off torch work runs on a thread that ends with it (services/worker/threads.py)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from services.worker.threads import run_in_own_thread


def test_the_work_runs_on_a_thread_of_its_own_that_has_ended_when_it_returns():
    def work(x):
        return x * 2, threading.current_thread()

    async def main():
        return await run_in_own_thread(work, 21, name="load-test")

    result, thread = asyncio.run(main())
    assert result == 42
    assert thread is not threading.main_thread() and thread.name.startswith("load-test")
    assert not thread.is_alive()  # its OpenMP team, if it made one, went with it


def test_an_exception_reaches_the_caller_and_the_thread_still_ends():
    seen = []

    def work():
        seen.append(threading.current_thread())
        raise ValueError("no such model")

    with pytest.raises(ValueError, match="no such model"):
        asyncio.run(run_in_own_thread(work))
    assert not seen[0].is_alive()

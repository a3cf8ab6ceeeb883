"""Running a search's coroutines to the end from synchronous code (a script, a command, a notebook cell)."""

from __future__ import annotations

import asyncio
import signal
import threading
from collections.abc import Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")


def run_sync(coro: Coroutine[object, object, T]) -> T:
    """Run a search (or several) to the end from synchronous code, also where an event loop is
    already running (a notebook cell), by running it on a loop of its own in a thread."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return _run_here(coro)
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


def _run_here(coro: Coroutine[object, object, T]) -> T:
    """asyncio.run, with SIGTERM taken as asyncio takes Ctrl-C: the signal cancels the run's task, so
    every task unwinds inside the loop, and the handler in place before runs once the loop is closed.
    A handler that raises inside the loop stops it between two tasks' steps: a gather then hands the
    error to a task already told to cancel, the loop closes with tasks unfinished, and their cleanup
    runs later, outside any loop, with a traceback."""
    previous = signal.getsignal(signal.SIGTERM)
    if threading.current_thread() is not threading.main_thread() or previous in (signal.SIG_IGN, None):
        return asyncio.run(coro)
    received: list[int] = []

    async def main() -> T:
        task = asyncio.current_task()
        assert task is not None

        def cancel() -> None:
            received.append(signal.SIGTERM)
            task.cancel()

        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, cancel)
        return await coro

    try:
        return asyncio.run(main())
    finally:
        signal.signal(signal.SIGTERM, previous)  # the loop's own handler goes with the loop
        if received:
            if callable(previous):
                previous(signal.SIGTERM, None)
            else:
                signal.raise_signal(signal.SIGTERM)

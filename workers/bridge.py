"""The worker process's asyncio loop, in a thread of its own, for Celery's pool threads to run
coroutines on.

Celery runs batches in pool threads; everything that talks to the server or to Redis
asynchronously (the backend's watchers, the batches' requests, the leases' heartbeats) runs on
this one loop, so all batches of the process share one client and one in-flight limit.

    loop = LoopThread()
    loop.start()
    answer = loop.run(coroutine)  # from any other thread
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from workers import loops

T = TypeVar("T")
# How long stopping waits for the loop's thread to end.
STOP_WAIT_S = 10.0


class LoopThread:
    """An event loop running forever in a daemon thread (`run` and `submit` hand it work)."""

    def __init__(self, name: str = "fleetgen-loop") -> None:
        self._loop = loops.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop the loop and wait for its thread; what ran on it has been closed by then."""
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=STOP_WAIT_S)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run `coro` on the loop and wait for its result (from a thread other than the loop's)."""
        return self.submit(coro).result(timeout)

    def call_soon(self, callback: Callable[[], object]) -> None:
        """Run `callback` on the loop soon, from any thread or a signal handler (it appends to
        the loop's queue and wakes it, taking no lock)."""
        self._loop.call_soon_threadsafe(callback)

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedule `coro` on the loop, from any thread, the loop's own included."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

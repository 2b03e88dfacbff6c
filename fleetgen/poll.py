"""Waiting on a condition: look every interval until it holds or a deadline passes.

Every process that waits for something it cannot be told about (a server to answer, a file to
say a restart is done, a job to finish) waits this way, on tenacity like the retries beside it
(fleetgen/retry.py): the condition is checked at once, then every `interval_s`, and once more
at the deadline.

    wait_until(lambda: client.ping(), 5, what="redis to answer PING")  # or TimeoutError
    rollout = poll(finished_rollout, timeout_s=30, interval_s=0.2)     # or None after 30 s

An exception from the condition ends the wait at once and propagates, so a condition can fail
fast (a process that exited will never answer).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from tenacity import RetryCallState, Retrying, retry_if_result, stop_after_delay

T = TypeVar("T")


def poll(check: Callable[[], T | None], timeout_s: float, interval_s: float) -> T | None:
    """`check()` until it returns something other than None, which is returned; None once
    `timeout_s` passed without."""
    def wait(state: RetryCallState) -> float:  # never sleep past the deadline
        return max(0.0, min(interval_s, timeout_s - (state.seconds_since_start or 0.0)))

    retrying = Retrying(retry=retry_if_result(lambda found: found is None),
                        stop=stop_after_delay(timeout_s), wait=wait,
                        retry_error_callback=lambda state: None)
    return retrying(check)


def wait_until(predicate: Callable[[], object], timeout: float, interval: float = 0.05,
               what: str = "") -> None:
    """Poll `predicate` until it returns something true; raise TimeoutError naming `what`
    after `timeout` seconds."""
    if poll(lambda: True if predicate() else None, timeout, interval) is None:
        name = what or getattr(predicate, "__name__", "a condition")
        raise TimeoutError(f"timed out after {timeout:.1f}s waiting for {name}")

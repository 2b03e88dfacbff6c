"""The one backoff policy, and the retries built on it (tenacity).

Every retry fleetgen makes waits the same way: exponential backoff with full jitter, capped —
try n waits a random time up to `initial × 2^(n-1)`, never more than the cap — so workers that
lost the same Redis or S3 at the same moment do not come back in lockstep. Each retry is
bounded by a deadline (an outage) or a number of attempts (a prompt):

- `on_redis`, `on_redis_async`: ledger reads and writes ride through a Redis restart (kill -9
  with AOF on, failover: seconds). A finished prompt's checkpoint or a batch's completion
  record must not be dropped for that; past the deadline the error is raised and the
  reconciler's rules take over.
- `on_sink`: a sink read or write rides through an S3 outage (FLEETGEN_SINK_RETRY_DEADLINE_S).
- `with_attempts`: one prompt's transient failures (workers/batch.py).

    value = on_redis("finish b000001", lambda: ledger.batches.finish_and_settle(...))
"""

from __future__ import annotations

import logging
import random
from collections.abc import Awaitable, Callable
from typing import TypeVar

import redis
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    Retrying,
    retry_if_exception_type,
    stop_after_attempt,
    stop_before_delay,
    wait_random_exponential,
)
from tenacity.wait import wait_base

from fleetgen.errors import RetryableError, SinkError

log = logging.getLogger(__name__)
T = TypeVar("T")

REDIS_ERRORS = (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError)
# What Redis answers that no retry mends, for callers that say so in their own words (these
# names keep `redis` out of them): the password refused (a ConnectionError too, so catch it
# first), and a command the user's ACL denies.
RedisAuthError = redis.AuthenticationError
RedisNoPermissionError = redis.exceptions.NoPermissionError
# Redis not reached at all (refused, unknown host, timed out connecting).
RedisConnectionError = redis.ConnectionError
# Something answered that does not speak Redis's protocol (an HTTP server at REDIS_URL's port).
RedisProtocolError = redis.exceptions.InvalidResponse
# A lock (the job's, fleetgen/creation.py) released or renewed after it expired.
RedisLockError = redis.exceptions.LockError
# A Redis restart with an AOF to reload takes seconds; two minutes covers a slow one.
REDIS_OUTAGE_S = 120.0
REDIS_BACKOFF_S, REDIS_BACKOFF_MAX_S = 0.2, 5.0
SINK_BACKOFF_S, SINK_BACKOFF_MAX_S = 1.0, 15.0


def backoff(initial_s: float, max_s: float) -> wait_base:
    """The policy: a random wait up to `initial_s × 2^(n-1)` before try n+1, capped at `max_s`."""
    return wait_random_exponential(multiplier=initial_s, max=max_s)


def backoff_delay(
    n: int, initial_s: float, max_s: float,
    uniform: Callable[[float, float], float] = random.uniform,
) -> float:
    """The policy's wait before try n+1, for waits no tenacity loop drives (the worker's
    overload and probe waits, the node supervisor's restarts): the same draw as `backoff`.
    `uniform` is the random source; a test passes its own to replay a history."""
    # The exponent's cap keeps a long count from overflowing a float; the wait is capped anyway.
    return uniform(0.0, min(max_s, initial_s * 2.0 ** min(max(0, n - 1), 64)))


def _said(what: str, outage: str) -> Callable[[RetryCallState], None]:
    def before_sleep(state: RetryCallState) -> None:
        exc = state.outcome.exception() if state.outcome else None
        wait = state.next_action.sleep if state.next_action else 0.0
        log.info("%s: %s (%s); retrying in %.1fs", what, outage, exc, wait)
    return before_sleep


def on_redis(what: str, call: Callable[[], T], deadline_s: float = REDIS_OUTAGE_S) -> T:
    """`call()`, tried again through a Redis outage until `deadline_s` would pass."""
    retrying = Retrying(
        retry=retry_if_exception_type(REDIS_ERRORS), stop=stop_before_delay(deadline_s),
        wait=backoff(REDIS_BACKOFF_S, REDIS_BACKOFF_MAX_S), reraise=True,
        before_sleep=_said(what, "Redis unavailable"))
    return retrying(call)


async def on_redis_async(
    what: str, call: Callable[[], Awaitable[T]], deadline_s: float = REDIS_OUTAGE_S
) -> T:
    """`await call()`, tried again through a Redis outage until `deadline_s` would pass."""
    retrying = AsyncRetrying(
        retry=retry_if_exception_type(REDIS_ERRORS), stop=stop_before_delay(deadline_s),
        wait=backoff(REDIS_BACKOFF_S, REDIS_BACKOFF_MAX_S), reraise=True,
        before_sleep=_said(what, "Redis unavailable"))

    async def once() -> T:
        # tenacity awaits only coroutine functions; `call` may be a lambda returning one.
        return await call()

    return await retrying(once)


def on_sink(call: Callable[[], T], *, deadline_s: float, what: str = "sink") -> T:
    """`call()` (a read or a write) until it succeeds or `deadline_s` would pass, riding
    through a sink outage; the sink's counterpart of `on_redis`."""
    retrying = Retrying(
        retry=retry_if_exception_type(SinkError), stop=stop_before_delay(deadline_s),
        wait=backoff(SINK_BACKOFF_S, SINK_BACKOFF_MAX_S), reraise=True,
        before_sleep=_said(what, "sink unavailable"))
    return retrying(call)


async def with_attempts(
    what: str, call: Callable[[], Awaitable[T]], max_attempts: int, initial_s: float,
    max_s: float,
) -> T:
    """`await call()`, tried again on a RetryableError (5xx, timeout, reset) up to
    `max_attempts` tries in all, with the policy's waits between them; any other error ends
    the tries at once.

    The first try runs before any tenacity state exists: nearly every prompt is answered at
    once, and building a retry state for each of them is a measurable share of the worker's
    CPU at an instant server's rate. A failed first try becomes tenacity's first, so waits, logs and the
    limit are as if tenacity had made it."""
    try:
        return await call()
    except RetryableError as exc:
        if max_attempts <= 1:
            raise
        failed = [exc]

    async def again() -> T:
        if failed:
            raise failed.pop()
        return await call()

    retrying = AsyncRetrying(
        retry=retry_if_exception_type(RetryableError), stop=stop_after_attempt(max_attempts),
        wait=backoff(initial_s, max_s), reraise=True, before_sleep=_said(what, "retryable"))
    return await retrying(again)

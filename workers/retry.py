"""Riding through a Redis outage: the one retry policy for ledger writes, named and bounded.

Redis restarts (kill -9 with AOF on, failover) take seconds; a finished prompt's checkpoint
or a batch's completion record must not be dropped for that. Past the deadline the error is
raised and the reconciler's rules take over.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import redis

log = logging.getLogger(__name__)
T = TypeVar("T")

REDIS_ERRORS = (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError)
# A Redis restart with an AOF to reload takes seconds; two minutes covers a slow one.
REDIS_OUTAGE_S = 120.0


def on_redis(what: str, call: Callable[[], T], deadline_s: float = REDIS_OUTAGE_S) -> T:
    stop = time.monotonic() + deadline_s
    delay = 0.2
    while True:
        try:
            return call()
        except REDIS_ERRORS as exc:
            if time.monotonic() + delay > stop:
                raise
            log.info("%s: Redis unavailable (%s); retrying in %.1fs", what, exc, delay)
            time.sleep(delay)
            delay = min(delay * 2, 5.0)


async def on_redis_async(
    what: str, call: Callable[[], Awaitable[T]], deadline_s: float = REDIS_OUTAGE_S
) -> T:
    stop = time.monotonic() + deadline_s
    delay = 0.2
    while True:
        try:
            return await call()
        except REDIS_ERRORS as exc:
            if time.monotonic() + delay > stop:
                raise
            log.info("%s: Redis unavailable (%s); retrying in %.1fs", what, exc, delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 5.0)

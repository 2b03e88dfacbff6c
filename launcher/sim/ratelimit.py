"""A hosted endpoint's request budget (`--rpm N`): at most N generation requests in any
rolling minute of wall clock, every one counted (a one-token probe too).

Every answer of a generation route carries OpenAI's headers, `x-ratelimit-limit-requests`,
`x-ratelimit-remaining-requests` (after this request) and `x-ratelimit-reset-requests` (how
long until the oldest request in the window leaves it, `1.5s`, `6m0s`, as OpenAI writes a
duration). Beyond the budget the answer is OpenAI's 429 with `retry-after` (that wait, whole
seconds rounded up). A refused request does not use the budget.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable

import orjson

from launcher.sim.protocol import RequestError

WINDOW_S = 60.0
Headers = tuple[tuple[bytes, bytes], ...]


def duration(seconds: float) -> str:
    """A duration as OpenAI's headers write it (Go's): `120ms`, `1.5s`, `6m0s`, `1h0m0s`."""
    ms = round(seconds * 1000)
    if ms < 1000:
        return f"{ms}ms"
    hours, rest = divmod(ms, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    secs = f"{rest / 1000:.3f}".rstrip("0").rstrip(".")
    if hours:
        return f"{hours}h{minutes}m{secs}s"
    return f"{minutes}m{secs}s" if minutes else f"{secs}s"


class RequestBudget:
    """The requests taken in the last minute, against `limit` (None: no budget)."""

    def __init__(self, limit: int | None, now: Callable[[], float] = time.monotonic) -> None:
        self.limit = limit
        self._now = now
        self._taken: deque[float] = deque()

    def set_limit(self, limit: int | None) -> None:
        """A new budget; the minute's requests still count against it (none without one)."""
        self.limit = limit
        if limit is None:
            self._taken.clear()

    def used(self) -> int:
        """Requests taken in the last minute."""
        self._expire(self._now())
        return len(self._taken)

    def take(self) -> Headers:
        """Count one request and give the headers of its answer; raise the 429 that refuses
        it (those headers and `retry-after` with it) when the budget is spent."""
        limit = self.limit
        assert limit is not None, "take() without a budget"
        now = self._now()
        taken = self._taken
        self._expire(now)
        if len(taken) >= limit:
            wait = taken[0] + WINDOW_S - now
            message = (f"Rate limit reached for requests per min (RPM): Limit {limit}, Used "
                       f"{len(taken)}, Requested 1. Please try again in {duration(wait)}.")
            body = orjson.dumps({"error": {"message": message, "type": "requests",
                                           "param": None, "code": "rate_limit_exceeded"}})
            headers = {"retry-after": str(max(1, math.ceil(wait)))}
            headers.update((k.decode(), v.decode()) for k, v in _headers(limit, 0, wait))
            raise RequestError(429, body, headers)
        taken.append(now)
        return _headers(limit, limit - len(taken), taken[0] + WINDOW_S - now)

    def _expire(self, now: float) -> None:
        taken = self._taken
        while taken and taken[0] <= now - WINDOW_S:
            taken.popleft()


def _headers(limit: int, remaining: int, reset_s: float) -> Headers:
    return ((b"x-ratelimit-limit-requests", str(limit).encode()),
            (b"x-ratelimit-remaining-requests", str(max(0, remaining)).encode()),
            (b"x-ratelimit-reset-requests", duration(max(0.0, reset_s)).encode()))

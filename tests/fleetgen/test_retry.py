"""The one backoff policy (fleetgen/retry.py): outages are ridden through up to a deadline,
a prompt gets a bounded number of tries of a transient error and none of a 4xx."""

from __future__ import annotations

import asyncio

import pytest
import redis

from fleetgen.errors import BadRequestError, RetryableError, SinkError
from fleetgen.retry import backoff, on_redis, on_redis_async, on_sink, with_attempts


def failing(times: int, error: Exception) -> tuple[list[int], object]:
    calls: list[int] = []

    def call() -> str:
        calls.append(1)
        if len(calls) <= times:
            raise error
        return "done"

    return calls, call


def test_a_redis_outage_shorter_than_the_deadline_is_ridden_through() -> None:
    calls, call = failing(2, redis.ConnectionError("restarting"))
    assert on_redis("test", call, deadline_s=30) == "done"  # type: ignore[arg-type]
    assert len(calls) == 3


def test_an_async_redis_call_given_as_a_lambda_is_awaited_and_ridden_through() -> None:
    calls: list[int] = []

    async def script() -> list[int]:
        calls.append(1)
        if len(calls) < 3:
            raise redis.TimeoutError("loading")
        return [1, 0]

    reply = asyncio.run(on_redis_async("test", lambda: script(), deadline_s=30))
    assert (reply, len(calls)) == ([1, 0], 3)


def test_past_the_deadline_the_outage_error_itself_is_raised() -> None:
    calls, call = failing(100, SinkError("S3 down"))
    with pytest.raises(SinkError, match="S3 down"):
        on_sink(call, deadline_s=0.0)  # type: ignore[arg-type]
    assert len(calls) == 1


def test_a_prompt_gets_its_tries_of_a_retryable_error_and_one_of_a_4xx() -> None:
    async def tries(error: Exception, fail_first: int = 100) -> tuple[int, str | None]:
        count = 0

        async def call() -> str:
            nonlocal count
            count += 1
            if count <= fail_first:
                raise error
            return f"answered on try {count}"

        try:
            answer = await with_attempts("prompt p1", call, 4, 0.001, 0.002)
        except type(error):
            return count, None
        return count, answer

    assert asyncio.run(tries(RetryableError("HTTP 500"))) == (4, None)
    assert asyncio.run(tries(BadRequestError("HTTP 400"))) == (1, None)
    # The first try is made outside tenacity: a failure there is still followed by the rest.
    assert asyncio.run(tries(RetryableError("HTTP 500"), fail_first=1)) == (
        2, "answered on try 2")
    assert asyncio.run(tries(RetryableError("HTTP 500"), fail_first=0)) == (
        1, "answered on try 1")


def test_the_waits_grow_from_the_initial_wait_up_to_the_cap_never_above() -> None:
    from tenacity import RetryCallState, Retrying

    wait = backoff(1.0, 8.0)
    state = RetryCallState(Retrying(), fn=None, args=(), kwargs={})
    highs = []
    for n in range(1, 8):
        state.attempt_number = n
        highs.append(max(wait(state) for _ in range(200)))
    assert all(h <= 8.0 for h in highs)
    assert highs[0] <= 1.0 and highs[-1] > 4.0

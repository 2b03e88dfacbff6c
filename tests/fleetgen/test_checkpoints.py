"""Group-committed checkpoints (fleetgen/checkpoints.py) on a real Redis."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import orjson
import pytest
import redis.asyncio as aioredis

from fleetgen import keys
from fleetgen.checkpoints import GROUP_RECORDS, CheckpointWriter, Entry

JOB = "cp-job"


def entry(i: int, batch: str = "b000000", tokens: int = 10) -> Entry:
    record = {"id": f"p{i}", "content": "answer"}
    return Entry(JOB, batch, f"p{i}", orjson.dumps(record),
                 {"prompts_done": 1, "output_tokens": tokens}, orjson.dumps([f"p{i}"]))


class Recorder:
    """The writer's judge: records (before, after) of each group that moved the canary."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int]] = []

    async def __call__(self, job: str, before: int, after: int) -> None:
        self.calls.append((before, after))


async def with_writer(redis_url: str, window: int, body: Any, commit_window_s: float = 0.0) -> Any:
    r = aioredis.Redis.from_url(redis_url)
    judge = Recorder()
    writer = CheckpointWriter(r, "gpu0@test", judge, lambda job: window, commit_window_s)
    # Round trips counted by Redis itself: its EVALSHA (and EVAL on NOSCRIPT) calls from now.
    await r.config_resetstat()
    try:
        return await body(writer, judge, r)
    finally:
        await r.aclose()


async def script_calls(r: Any) -> int:
    stats = await r.info("commandstats")
    return sum(int(stats.get(f"cmdstat_{name}", {}).get("calls", 0)) for name in ("evalsha", "eval"))


def test_concurrent_records_share_script_calls_and_count_once(redis_url: str,
                                                              redis_client: Any) -> None:
    async def body(writer: CheckpointWriter, judge: Recorder, r: Any) -> None:
        firsts = await asyncio.gather(*(writer.add(entry(i, f"b{i % 3:06d}")) for i in range(300)))
        assert all(firsts)
        assert 0 < await script_calls(r) < 30  # grouped: 300 records in a handful of calls
        again = await asyncio.gather(*(writer.add(entry(i, f"b{i % 3:06d}")) for i in range(10)))
        assert not any(again)  # a re-run's copies are not first copies

    asyncio.run(with_writer(redis_url, 200, body))
    stats = {k.decode(): float(v) for k, v in
             redis_client.hgetall(keys.job_part(JOB, "stats")).items()}
    assert stats == {"prompts_done": 300.0, "output_tokens": 3000.0}
    assert sum(redis_client.hlen(keys.checkpoint(JOB, f"b{b:06d}")) for b in range(3)) == 300
    workers = redis_client.hgetall(keys.job_part(JOB, "workers"))
    assert float(workers[b"gpu0@test|prompts_done"]) == 300.0
    assert redis_client.llen(keys.job_part(JOB, "recent")) == 200  # trimmed to the window
    assert int(redis_client.hget(keys.job(JOB), "canary_seen")) == 300


def test_judge_hears_each_group_that_moved_the_canary_and_window_zero_skips_it(
        redis_url: str, redis_client: Any) -> None:
    async def fed(writer: CheckpointWriter, judge: Recorder, r: Any) -> list[Any]:
        for i in range(5):
            await writer.add(entry(i))
        await writer.add(entry(0))  # duplicate: moves nothing, judged nothing
        return judge.calls

    assert asyncio.run(with_writer(redis_url, 200, fed)) == [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5)]
    redis_client.flushdb()
    assert asyncio.run(with_writer(redis_url, 0, fed)) == []
    assert redis_client.llen(keys.job_part(JOB, "recent")) == 0
    assert float(redis_client.hget(keys.job_part(JOB, "stats"), "prompts_done")) == 5.0


def test_a_commit_window_puts_prompts_finishing_one_by_one_into_one_call_counted_once(
        redis_url: str, redis_client: Any) -> None:
    # Ten prompts finishing 10 ms apart: without a window each gets its own call (an idle
    # Redis answers first); a window of 2 s (wide, for a busy machine) takes them all in one,
    # counters summed once.
    async def trickle(writer: CheckpointWriter, judge: Recorder, r: Any) -> int:
        async def finish(i: int) -> bool:
            await asyncio.sleep(0.01 * i)
            return await writer.add(entry(i, tokens=i))

        assert all(await asyncio.gather(*(finish(i) for i in range(10))))
        return await script_calls(r)

    assert asyncio.run(with_writer(redis_url, 0, trickle, commit_window_s=2.0)) == 1
    stats = {k.decode(): float(v) for k, v in
             redis_client.hgetall(keys.job_part(JOB, "stats")).items()}
    assert stats == {"prompts_done": 10.0, "output_tokens": 45.0}
    minutes = redis_client.hgetall(keys.job_part(JOB, "minutes"))
    assert sum(float(v) for k, v in minutes.items() if b"|" not in k) == 10.0


def test_a_group_closes_at_its_size_without_waiting_for_its_window(redis_url: str) -> None:
    # A window of a minute: 128 records at once are two full groups, sent at once; the
    # wait_for (well under the window) fails the test if either waited for the window.
    async def full(writer: CheckpointWriter, judge: Recorder, r: Any) -> int:
        adds = asyncio.gather(*(writer.add(entry(i)) for i in range(2 * GROUP_RECORDS)))
        assert all(await asyncio.wait_for(adds, 30.0))
        return await script_calls(r)

    assert asyncio.run(with_writer(redis_url, 0, full, commit_window_s=60.0)) == 2


@pytest.mark.parametrize("closing", [
    # a failure: the breaker judges it now
    {"outcome": "invalid_request"},
    # the last answer its batch waits for: the batch ends now, not a window later
    {"closes": True},
], ids=["a-failure", "a-batchs-last-answer"])
def test_an_entry_that_closes_its_group_sends_it_without_waiting_for_its_window(
        closing: dict[str, Any], redis_url: str, redis_client: Any) -> None:
    # A window of a minute, one answer waiting in it: the entry added after it closes the
    # group at once, both in one call.
    async def closed(writer: CheckpointWriter, judge: Recorder, r: Any) -> int:
        answer = writer.add(entry(0))
        last = writer.add(dataclasses.replace(entry(1), **closing))
        assert all(await asyncio.wait_for(asyncio.gather(answer, last), 30.0))
        return await script_calls(r)

    assert asyncio.run(with_writer(redis_url, 0, closed, commit_window_s=60.0)) == 1


async def noting(redis_url: str, *notes: tuple[int, bool]) -> None:
    """Note answers that skip the checkpoint, (count, closes) each at once, with a breaker that
    keeps 100 outcomes and a window of a minute; fails if they wait for the window."""
    r = aioredis.Redis.from_url(redis_url)

    async def judge_failures(job: str, entries: list[Entry], seen: Any) -> None:
        return None

    writer = CheckpointWriter(r, "gpu0@test", Recorder(), lambda job: 0, 60.0,
                              judge_failures, 100)
    try:
        await asyncio.wait_for(asyncio.gather(
            *(writer.answered(JOB, count, closes=closes) for count, closes in notes)), 30.0)
    finally:
        await r.aclose()


def test_a_batchs_last_answer_noted_closes_its_group_without_waiting_for_its_window(
        redis_url: str, redis_client: Any) -> None:
    # An embeddings batch's last answer, noted for the breaker: no window either.
    asyncio.run(noting(redis_url, (3, False), (1, True)))
    assert redis_client.llen(keys.job_part(JOB, "outcomes")) == 4


def test_a_group_with_copies_already_there_counts_only_its_first_copies(
        redis_url: str, redis_client: Any) -> None:
    # The group's sums come from the writer; when some of its records were there already the
    # script sums the first copies' own values again, and a counter that only a duplicate
    # carries is not created.
    def rerun(i: int, tokens: int) -> Entry:
        e = entry(i, tokens=tokens)
        return Entry(e.job, e.batch, e.prompt_id, e.record,
                     {**e.counters, "finish_length": 1}, e.fact)

    async def body(writer: CheckpointWriter, judge: Recorder, r: Any) -> list[bool]:
        await asyncio.gather(*(writer.add(entry(i, tokens=i)) for i in range(5)))
        return list(await asyncio.gather(writer.add(rerun(3, 100)), writer.add(entry(5, tokens=7)),
                                         writer.add(rerun(0, 50)), writer.add(entry(6, tokens=2))))

    assert asyncio.run(with_writer(redis_url, 0, body)) == [False, True, False, True]
    stats = {k.decode(): float(v) for k, v in
             redis_client.hgetall(keys.job_part(JOB, "stats")).items()}
    assert stats == {"prompts_done": 7.0, "output_tokens": 0 + 1 + 2 + 3 + 4 + 7 + 2}
    workers = redis_client.hgetall(keys.job_part(JOB, "workers"))
    assert float(workers[b"gpu0@test|output_tokens"]) == 19.0
    assert orjson.loads(redis_client.hget(keys.checkpoint(JOB, "b000000"), "p3")) == {
        "id": "p3", "content": "answer"}


def test_answers_that_skip_the_checkpoint_reach_the_breakers_window_in_the_next_group_call(
        redis_url: str, redis_client: Any) -> None:
    # An embeddings batch's answers are noted by number: a call of their own when no record
    # comes with them, ahead of the group's records when one does; never past the window.
    async def noted(writer: CheckpointWriter, r: Any) -> None:
        e = entry(9)
        failure = Entry(e.job, e.batch, e.prompt_id, e.record, e.counters, e.fact,
                        outcome="invalid_request: nope")
        await asyncio.gather(writer.answered(JOB, 3), writer.answered(JOB, 2), writer.add(failure))
        assert await r.lrange(keys.job_part(JOB, "outcomes"), 0, -1) \
            == [b"invalid_request: nope"] + [b""] * 5
        await writer.answered(JOB, 500)

    async def body(breaker_kept: int) -> int:
        r = aioredis.Redis.from_url(redis_url)
        failures: list[str] = []

        async def judge_failures(job: str, entries: list[Entry], seen: Any) -> None:
            failures.extend(e.prompt_id for e in entries)

        writer = CheckpointWriter(r, "gpu0@test", Recorder(), lambda job: 0, 0.5,
                                  judge_failures, breaker_kept)
        await r.config_resetstat()
        try:
            if breaker_kept:
                await asyncio.wait_for(noted(writer, r), 30.0)
                assert failures == ["p9"]
            else:
                await writer.answered(JOB, 3)  # the breaker off: nothing to note, no call
            return await script_calls(r)
        finally:
            await r.aclose()

    assert asyncio.run(body(10)) == 2
    assert redis_client.lrange(keys.job_part(JOB, "outcomes"), 0, -1) \
        == [b""] * 10  # the 500 answers pushed the failure and the others out
    stats = {k.decode(): float(v) for k, v in
             redis_client.hgetall(keys.job_part(JOB, "stats")).items()}
    assert stats == {"prompts_done": 1.0, "output_tokens": 10.0}  # the record's alone
    redis_client.flushdb()
    assert asyncio.run(body(0)) == 0
    assert not redis_client.exists(keys.job_part(JOB, "outcomes"))


def test_a_group_closes_at_its_size_in_answers_noted_without_waiting_for_its_window(
        redis_url: str, redis_client: Any) -> None:
    # An embeddings request's answers, noted together, close their group as its records did.
    asyncio.run(noting(redis_url, (GROUP_RECORDS, False)))
    assert redis_client.llen(keys.job_part(JOB, "outcomes")) == GROUP_RECORDS

"""Per-prompt checkpoints, committed in groups: one Redis call per group, not per prompt.

A finished prompt's record must reach Redis before its batch is written (a crash then loses
only requests in flight and the group being gathered), but one script call per prompt made
Redis round trips half of a worker's CPU against an instant server, and the call, not the
record, most of Redis's CPU per prompt: a fleet of short requests (embeddings, short chats)
would need a Redis core for a few hundred GPUs. `CheckpointWriter.add` queues a record and
waits; a group closes when `GROUP_RECORDS` records are queued or its window (the settings'
`checkpoint_window_s`) after its oldest record came, or a batch's last answer comes (the
batch waits for nothing more), whichever is first, and is sent once the previous call is
back. A loaded worker fills a group at once; a slow one still commits every record within the
window, and no batch waits a window at its end.

The script adds each record once (HSETNX). Counters, the per-worker and per-minute tallies,
the canary's window and the failure breaker's window move only for a first copy, so a prompt
re-run after a crash, or a group retried after a Redis blip, is never counted twice. A group
that recorded a failure gets the breaker's window back in the same reply, so the breaker
judges it (and holds the job) without another round trip while failures pour in.

An embeddings job's answers are not checkpointed: a vector is kilobytes, most of Redis's cost
per record, and a batch of them is seconds of a GPU, so the batch is their group (the worker
keeps them until it writes the batch, and a crash loses that batch's answers, asked again by
its next run; Batches.finish_and_settle counts them once). `CheckpointWriter.answered` only
notes how many there were, for the failure breaker's window, in the next group's call.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis

from fleetgen import keys
from fleetgen.ledger import script
from fleetgen.retry import REDIS_ERRORS, on_redis_async

log = logging.getLogger(__name__)

# Adds a group of records, each once; its KEYS and ARGV are built by `group_arguments`.
RECORD_GROUP = script("record_group.lua")
# A group closes at this many records: an embeddings request's texts (the worker packs up to
# 64 a request) go in one call, and past it the call's own cost is a small share of a
# record's, while a call stays short enough not to hold Redis up for others.
GROUP_RECORDS = 64


@dataclass(frozen=True)
class Entry:
    """One finished prompt: its record and what it adds to the job's counters."""

    job: str
    batch: str
    prompt_id: str
    record: bytes
    counters: dict[str, float]
    fact: bytes  # the canary's sample of the answer (canary.sample), JSON
    # The failure breaker's token (breaker.outcome): "" for an answer, the cause of a failure;
    # None: the breaker does not count it.
    outcome: str | None = None
    # The last answer its batch waits for: its group closes at once, so that a batch ends
    # when its last answer is in, not a window later.
    closes: bool = False


@dataclass
class _Pending:
    entry: Entry
    came: float  # loop time of its `add`
    done: asyncio.Future[bool] = field(repr=False)


@dataclass
class _Noted:
    job: str
    count: int  # answers not checkpointed (CheckpointWriter.answered)
    came: float
    done: asyncio.Future[bool] = field(repr=False)


@dataclass(frozen=True)
class Outcomes:
    """What the script read for the failure breaker after a group that recorded a failure."""

    state: bytes | None  # the job's state
    accepted: bytes | None  # its `breaker_accepted` causes (JSON)
    window: list[bytes]  # its outcomes, newest first


# Called with (job, canary_seen before the group, after it) once per group that moved it.
Judge = Callable[[str, int, int], Awaitable[None]]
# Called with (job, the group's first copies that failed, the window after the group) once
# per group that has any.
FailureJudge = Callable[[str, list[Entry], Outcomes], Awaitable[None]]


class CheckpointWriter:
    """Group commit of per-prompt records for one worker process (lives on its loop)."""

    def __init__(self, redis: aioredis.Redis, worker: str, judge: Judge,
                 canary_window: Callable[[str], int], window_s: float,
                 judge_failures: FailureJudge | None = None, outcomes_kept: int = 0) -> None:
        self._script = redis.register_script(RECORD_GROUP)
        # How long a group waits for more records after its oldest (0: none, a call as soon
        # as the previous is back).
        self._window_s = window_s
        self._worker = worker
        self._judge = judge
        self._canary_window = canary_window
        # The failure breaker's judge, and the outcomes a job's window keeps (0: none).
        self._judge_failures = judge_failures
        self._outcomes_kept = outcomes_kept if judge_failures is not None else 0
        self._queue: list[_Pending] = []
        # Answers not checkpointed, noted for the breaker's window: (job, how many, when).
        self._answers: list[_Noted] = []
        self._full = asyncio.Event()
        self._flushing: asyncio.Task[None] | None = None

    async def add(self, entry: Entry) -> bool:
        """Commit one record; True if it was the first copy (False: a re-run's duplicate)."""
        loop = asyncio.get_running_loop()
        pending = _Pending(entry, loop.time(), loop.create_future())
        self._queue.append(pending)
        # A failure closes its group at once: the breaker judges each group that has one,
        # and a job-wide refusal must pause the job within the breaker's window, not a
        # window plus a group.
        if len(self._queue) >= GROUP_RECORDS or entry.outcome or entry.closes:
            self._full.set()
        if self._flushing is None:
            self._flushing = asyncio.create_task(self._flush_all())
        return await pending.done

    async def answered(self, job: str, count: int, closes: bool = False) -> None:
        """Note `count` answers of `job` that skip the checkpoint (an embeddings batch's) in
        the failure breaker's window, with the next group, and wait for it as `add` does
        (`closes`: its batch's last, which closes the group at once); nothing to do when the
        breaker is off."""
        if not self._outcomes_kept or count <= 0:
            return
        loop = asyncio.get_running_loop()
        noted = _Noted(job, count, loop.time(), loop.create_future())
        self._answers.append(noted)
        # As many answers as a group's records close it: an embeddings request's waits for
        # nothing, as when its records filled a group.
        if closes or sum(n.count for n in self._answers) >= GROUP_RECORDS:
            self._full.set()
        if self._flushing is None:
            self._flushing = asyncio.create_task(self._flush_all())
        await noted.done

    async def _flush_all(self) -> None:
        try:
            while self._queue or self._answers:
                if self._window_s and not self._full.is_set():
                    oldest = min([p.came for p in self._queue[:1]]
                                 + [n.came for n in self._answers[:1]])
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout_at(oldest + self._window_s):
                            await self._full.wait()
                group, self._queue = self._queue[:GROUP_RECORDS], self._queue[GROUP_RECORDS:]
                noted, self._answers = self._answers, []
                answers: dict[str, list[_Noted]] = {}
                for n in noted:
                    answers.setdefault(n.job, []).append(n)
                # What is left closes the next group at once if it would have closed this one.
                if len(self._queue) >= GROUP_RECORDS or any(
                        p.entry.outcome or p.entry.closes for p in self._queue):
                    self._full.set()
                else:
                    self._full.clear()
                by_job: dict[str, list[_Pending]] = {}
                for p in group:
                    by_job.setdefault(p.entry.job, []).append(p)
                for job in answers:
                    by_job.setdefault(job, [])
                await asyncio.gather(*(self._commit(job, items, answers.get(job, []))
                                       for job, items in by_job.items()))
        finally:
            self._flushing = None

    async def _commit(self, job: str, items: list[_Pending], noted: list[_Noted]) -> None:
        answers = sum(n.count for n in noted)
        try:
            window = self._canary_window(job)
            minute = int(time.time() // 60)
            script_keys, args = group_arguments(job, [p.entry for p in items], self._worker,
                                                minute, window, self._outcomes_kept, answers)
            reply = await on_redis_async(
                f"job {job}: checkpoint {len(items)} prompts ({answers} answers noted)",
                lambda: self._script(keys=script_keys, args=args),
            )
        except BaseException as exc:
            waiting = [p.done for p in items] + [n.done for n in noted]
            for done in waiting:
                if not done.done():
                    done.set_exception(exc)
            if not isinstance(exc, Exception):
                raise
            return
        for n in noted:
            if not n.done.done():
                n.done.set_result(True)
        seen, firsts = int(reply[0]), [bool(x) for x in reply[1:1 + len(items)]]
        for p, first in zip(items, firsts, strict=True):
            if not p.done.done():
                p.done.set_result(first)
        failed = [p.entry for p, first in zip(items, firsts, strict=True)
                  if first and p.entry.outcome]
        breaker = reply[1 + len(items):]
        if failed and breaker and self._judge_failures is not None:
            try:
                await self._judge_failures(job, failed, Outcomes(breaker[0], breaker[1],
                                                                 list(breaker[2:])))
            except REDIS_ERRORS as exc:  # the next group with a failure judges the window again
                log.info("job %s: failure breaker skipped a group (%s)", job, exc)
        new = sum(firsts)
        if window and new:
            try:
                await self._judge(job, seen - new, seen)
            except REDIS_ERRORS as exc:  # the canary is advisory; the next group feeds it again
                log.info("job %s: canary skipped a group (%s)", job, exc)


def group_arguments(job: str, entries: list[Entry], worker: str, minute: int,
                    window: int, outcomes_kept: int = 0,
                    answers: int = 0) -> tuple[list[str], list[Any]]:
    """KEYS and ARGV of RECORD_GROUP for one job's entries (window 0: no canary;
    outcomes_kept 0: no failure breaker), after `answers` not checkpointed
    (`CheckpointWriter.answered`)."""
    script_keys = [keys.job_part(job, "stats"), keys.job_part(job, "workers"),
                   keys.job_part(job, "minutes"), keys.job_part(job, "recent"), keys.job(job),
                   keys.job_part(job, "worker_minutes"), keys.job_part(job, "outcomes")]
    # The group's sums, added in the entries' order (as the script adds them again over the
    # first copies alone when some entry is a duplicate).
    sums: dict[str, float] = {}
    for e in entries:
        for name, value in e.counters.items():
            sums[name] = sums.get(name, 0) + value
    names = list(sums)
    index: dict[str, int] = {}
    args: list[Any] = [worker, str(minute), window, outcomes_kept, answers, len(names)]
    for name in names:
        args += [name, sums[name]]
    for e in entries:
        if e.batch not in index:
            script_keys.append(keys.checkpoint(job, e.batch))
            index[e.batch] = len(script_keys)
        values = ",".join("" if (v := e.counters.get(name)) is None else repr(v) for name in names)
        args += [index[e.batch], e.prompt_id, e.record, e.fact,
                 "" if e.outcome is None else "+" + e.outcome, values]
    return script_keys, args

"""Batches: where each batch of a job stands (queued, running, done), its prompt-level
checkpoint, and its recording once written."""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import redis

from fleetgen import keys
from fleetgen.ledger._jobs import Jobs
from fleetgen.ledger._replies import members, scored, script
from fleetgen.ledger._shards import Shards
from fleetgen.records import FailureRecord, OutputRecord, read_record

# Enough recent failure reasons to explain a bad job without growing without bound.
FAILURES_KEPT = 200

# Records a written batch once: only the first call counts its prompts.
_FINISH = script("finish_batch.lua")
# Takes failures out of an unleased batch's checkpoint, with what they added to the counters.
_DROP_FAILURES = script("drop_failures.lua")


class Batches:
    """A job's batch sets (fg:job:{job}:queued, :running, :done) and checkpoints
    (fg:ckpt:{job}:{batch}). A batch moves `queued -> running -> done`; `running` means a
    worker holds its lease (`Leases`). Queuing or finishing one may finish the job or run it
    again, so both settle it (`Jobs.settle`), as their names say."""

    def __init__(self, client: redis.Redis | Shards, jobs: Jobs) -> None:
        self.shards = Shards.of(client)
        self._jobs = jobs
        self._finish = self.shards.fleet.register_script(_FINISH)
        self._drop_failures = self.shards.fleet.register_script(_DROP_FAILURES)

    def mark_queued_and_settle(self, name: str, batches: Iterable[str]) -> None:
        """Note the batches as dispatched now; if there are any, settle the job (`Jobs.settle`)."""
        now = time.time()
        mapping = {b: now for b in batches}
        if mapping:
            self.shards.client(name).zadd(keys.job_part(name, "queued"), mapping)
            # Work queued for a finished job (`requeue --failed` of a done one) runs it again.
            self._jobs.settle(name)

    def in_broker(self, grace_s: float = math.inf) -> set[tuple[str, str]]:
        """(job, batch) of every message waiting in a broker queue or held unacked by a worker;
        one held unacked longer than `grace_s` whose batch has no lease does not count (its
        worker died before leasing it). kombu's layout is read by `broker.waiting_batches`."""
        # Imported here: the ledger's importers that never touch the broker (the launcher's
        # tuning notes, the views) do not load Celery.
        from fleetgen import broker

        return broker.waiting_batches(self.shards.fleet, grace_s=grace_s)

    def unqueue(self, name: str, batch: str) -> None:
        self.shards.client(name).zrem(keys.job_part(name, "queued"), batch)

    def queued(self, name: str) -> dict[str, float]:
        """Batch -> when it was dispatched to the broker."""
        return scored(self.shards.client(name), keys.job_part(name, "queued"))

    def running(self, name: str) -> dict[str, float]:
        """Batch -> when its lease was taken."""
        return scored(self.shards.client(name), keys.job_part(name, "running"))

    def done(self, name: str) -> set[str]:
        return members(self.shards.client(name), keys.job_part(name, "done"))

    def is_done(self, name: str, batch: str) -> bool:
        return bool(self.shards.client(name).sismember(keys.job_part(name, "done"), batch))

    def drop_running(self, name: str, batch: str) -> None:
        """Take a batch whose worker is gone out of `running`, before it is dispatched again."""
        self.shards.client(name).zrem(keys.job_part(name, "running"), batch)

    def holds(self, name: str, batches: Iterable[str]) -> dict[str, tuple[str | None, int]]:
        """Batch -> the worker holding its lease (None when no lease is alive) and the prompts
        checkpointed in it so far, read in one round trip."""
        batches = list(batches)
        with self.shards.client(name).pipeline(transaction=False) as p:
            for batch in batches:
                p.get(keys.lease(name, batch))
                p.hlen(keys.checkpoint(name, batch))
            raw = p.execute()
        return {batch: (keys.lease_owner(token.decode()) if token is not None else None, int(n))
                for batch, token, n in zip(batches, raw[::2], raw[1::2], strict=True)}

    def checkpoint(self, name: str, batch: str) -> dict[str, OutputRecord]:
        """The batch's checkpointed records: prompt id -> its finished result."""
        raw = self.shards.client(name).hgetall(keys.checkpoint(name, batch))
        return {k.decode(): read_record(v) for k, v in raw.items()}  # type: ignore[union-attr]

    def checkpointed_records(self, name: str, batches: Iterable[str]) -> Iterator[bytes]:
        """Every checkpointed record (raw JSON) of the given batches, read in one round trip."""
        with self.shards.client(name).pipeline(transaction=False) as p:
            for batch in batches:
                p.hvals(keys.checkpoint(name, batch))
            for records in p.execute():
                yield from records

    def drop_failures(self, name: str, batch: str,
                      failures: Iterable[FailureRecord]) -> int | None:
        """Take these failure records out of the batch's checkpoint, so that its next run sends
        them again, and take back what they added to the live counters; returns how many were
        taken out. None, with nothing changed, while someone holds the batch's lease."""
        args: list[Any] = []
        for record in failures:
            args += [record["custom_id"], record["error"]["code"], record["worker"]]
        if not args:
            return 0
        taken = int(self._drop_failures(
            keys=[keys.checkpoint(name, batch), keys.lease(name, batch),
                  keys.job_part(name, "stats"), keys.job_part(name, "workers")], args=args,
            client=self.shards.client(name)))
        return None if taken < 0 else taken

    def finish_and_settle(
        self, name: str, batch: str, written: Mapping[str, float], worker: str,
        failures: list[bytes], bytes_written: int = 0, now: float | None = None,
        live: Mapping[str, float] | None = None,
    ) -> bool:
        """Record a batch whose objects are in the sink: done set and the written counters
        (`records.written_counts`), once per batch; drop its checkpoint and its rollouts'
        journal; the first to record it settles the job (`Jobs.settle`: its last batch finishes
        it). True if this call was the first. `worker` is who wrote it ("" when rebuilt from
        the sink). `live` is what the batch's answers that skipped the checkpoint add to the
        live counters (`records.answered_counts`: an embeddings batch's), added by the first
        call with the per-worker and per-minute tallies their checkpoint would have moved."""
        now = time.time() if now is None else now
        script_keys = [keys.job_part(name, "done"), keys.job_part(name, "running"),
                       keys.job_part(name, "queued"), keys.job_part(name, "written"),
                       keys.job(name), keys.checkpoint(name, batch),
                       keys.job_part(name, "failures"), keys.calls(name, batch)]
        args: list[Any] = [batch, now, FAILURES_KEPT, len(written)]
        for field, value in written.items():
            args += [field, value]
        increments = _increments(name, worker, int(now // 60), bytes_written, live or {})
        index: dict[str, int] = {}
        args.append(len(increments))
        for key, field, value in increments:
            if key not in index:
                script_keys.append(key)
                index[key] = len(script_keys)
            args += [index[key], field, value]
        first = bool(self._finish(keys=script_keys, args=args + failures,
                                  client=self.shards.client(name)))
        if first:
            self._jobs.settle(name)
        return first


# The live counters that also move per worker and per minute (as record_group.lua moves them
# at a checkpoint): the prompts ended and the output tokens.
_PER_WORKER = ("prompts_done", "prompts_failed", "output_tokens")
_PROMPTS = ("prompts_done", "prompts_failed")


def _increments(name: str, worker: str, minute: int, bytes_written: int,
                live: Mapping[str, float]) -> list[tuple[str, str, float]]:
    """(key, field, value) the first recording of a written batch adds besides its written
    counters: the batch itself, and `live` with its tallies (none per worker when `worker` is
    "")."""
    stats, workers = keys.job_part(name, "stats"), keys.job_part(name, "workers")
    minutes, worker_minutes = keys.job_part(name, "minutes"), keys.job_part(name, "worker_minutes")
    out: list[tuple[str, str, float]] = [(stats, "batches_done", 1),
                                         (stats, "bytes_written", bytes_written)]
    if worker:
        out.append((workers, f"{worker}|batches_done", 1))
    for field, value in live.items():
        out.append((stats, field, value))
        if worker and field in _PER_WORKER:
            out.append((workers, f"{worker}|{field}", value))
        if field in _PROMPTS:
            out.append((minutes, str(minute), value))
            if worker:
                out.append((worker_minutes, f"{worker}|{minute}|prompts", value))
        if field == "output_tokens":
            out.append((minutes, f"{minute}|tokens", value))
            if worker:
                out.append((worker_minutes, f"{worker}|{minute}|tokens", value))
    return out

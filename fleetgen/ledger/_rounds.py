"""Rounds: `requeue --failed`'s rounds of new batches, and the job's written work restored from
a reading of the sink."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import redis

from fleetgen import keys
from fleetgen.job import JobManifest
from fleetgen.ledger._jobs import save_job
from fleetgen.ledger._shards import Shards


class Rounds:
    """The job's requeue rounds (its round counter, keys.JOB_ROUNDS, and their batches,
    fg:job:{job}:extra) with what they take out of the failed figures, and `restore`: what the
    ledger says of the job's written work replaced by what the sink holds (producer/rebuild.py).
    The caller holds the job's lock (fleetgen/creation.py)."""

    def __init__(self, client: redis.Redis | Shards) -> None:
        self.shards = Shards.of(client)

    def next(self, name: str, after: int) -> int:
        """Number the job's next requeue round: one past its last in the ledger and `after`
        (the last the sink holds), so a round name is never used twice."""
        last = int(self.shards.client(name).hget(keys.job(name), keys.JOB_ROUNDS) or 0)
        number = max(last, after) + 1
        self.shards.client(name).hset(keys.job(name), keys.JOB_ROUNDS, number)
        return number

    def record(self, name: str, batches: list[str], failed_by_code: Mapping[str, int]) -> None:
        """Add a requeue round's batches to the job, their prompts out of the failed figures
        until the new batches are written; live and written counters move together, so
        `checkpointed` stays right."""
        requeued = sum(failed_by_code.values())
        with self.shards.client(name).pipeline() as p:
            p.sadd(keys.job_part(name, "extra"), *batches)
            for part in ("stats", "written"):
                p.hincrbyfloat(keys.job_part(name, part), "prompts_failed", -requeued)
                for code, n in failed_by_code.items():
                    p.hincrbyfloat(keys.job_part(name, part), f"error_{code}", -n)
            p.hincrbyfloat(keys.job_part(name, "stats"), "prompts_requeued", requeued)
            p.execute()

    def restore(self, manifest: JobManifest, *, done: Iterable[str], rounds: Iterable[str],
                last_round: int, written: Mapping[str, float], live: Mapping[str, float]) -> None:
        """Replace what the ledger says about the job's written work with what a reading of
        its sink found (producer/rebuild.py), in one transaction: the manifest (a job that had
        no state runs), the done set, the written counters, the requeue batches and the round
        counter (never lowered), and the live counters' tallies of prompts, failures, tokens
        and finish reasons. Work in hand (queued and running batches, leases, checkpoints) stays
        as it is."""
        name = manifest.name
        stats = keys.job_part(name, "stats")
        # Codes and finish reasons the reading did not find must not linger at their old value.
        fields: list[bytes] = self.shards.client(name).hkeys(stats)  # type: ignore[assignment]
        stale = [f for f in fields if f.startswith((b"error_", b"finish_"))]
        last = int(self.shards.client(name).hget(keys.job(name), keys.JOB_ROUNDS) or 0)
        done, rounds = list(done), list(rounds)
        counted: dict[Any, float] = dict(written)
        tallied: dict[Any, float] = dict(live)
        with self.shards.client(name).pipeline() as p:
            save_job(p, manifest)
            p.delete(keys.job_part(name, "done"), keys.job_part(name, "written"),
                     keys.job_part(name, "extra"))
            if done:
                p.sadd(keys.job_part(name, "done"), *done)
            if rounds:
                p.sadd(keys.job_part(name, "extra"), *rounds)
            if counted:
                p.hset(keys.job_part(name, "written"), mapping=counted)
            if stale:
                p.hdel(stats, *stale)
            if tallied:
                p.hset(stats, mapping=tallied)
            p.hset(keys.job(name), keys.JOB_ROUNDS, max(last, last_round))
            p.execute()

"""The Redis ledger: job manifests, batch states, leases, checkpoints and counters.

A batch moves `queued -> running -> done`; `running` means a worker holds its lease. The ledger
is bookkeeping for speed and visibility: the sink decides what is done, and `rebuild_done`
reconstructs the done set from it.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from importlib import resources
from typing import Any

import orjson
import redis

from workers import keys, redisconn
from workers.errors import JobError
from workers.job import JobManifest
from workers.settings import REDIS_MASTER_NAME, Settings

# `creating`: enqueue is still storing batch inputs; no worker, reconciler or export acts on
# the job until enqueue sets it `running` (after the last input and the final manifest).
STATE_CREATING = "creating"
STATE_RUNNING = "running"
STATE_PAUSED = "paused"
STATE_CANCELLED = "cancelled"
JOB_STATES = (STATE_CREATING, STATE_RUNNING, STATE_PAUSED, STATE_CANCELLED)
# Enough recent failure reasons to explain a bad job without growing without bound.
FAILURES_KEPT = 200

# The scripts live beside this module (package data: pyproject.toml); each file says what its
# KEYS and ARGV are.
# Extends a lease only for its owner (the batch runner's heartbeat runs it on its loop).
RENEW_LEASE = resources.files("workers").joinpath("renew_lease.lua").read_text(encoding="utf-8")
# Gives a lease back if still held, refunding the attempt if asked.
_RELEASE = resources.files("workers").joinpath("release_lease.lua").read_text(encoding="utf-8")
# Records a written batch once: only the first call counts its prompts.
_FINISH = resources.files("workers").joinpath("finish_batch.lua").read_text(encoding="utf-8")
# Takes failures out of an unleased batch's checkpoint, with what they added to the counters.
_DROP_FAILURES = resources.files("workers").joinpath("drop_failures.lua").read_text(
    encoding="utf-8")


class Ledger:
    """Synchronous ledger operations on one Redis connection pool."""

    def __init__(self, client: redis.Redis) -> None:
        self.r = client
        self._release = client.register_script(_RELEASE)
        self._finish = client.register_script(_FINISH)
        self._drop_failures = client.register_script(_DROP_FAILURES)

    @classmethod
    def from_url(cls, url: str, client_name: str | None = None,
                 master_name: str = REDIS_MASTER_NAME) -> Ledger:
        """A ledger on the Redis `url` names: a server, or the master of Sentinels."""
        return cls(redisconn.client(
            url, master_name, socket_timeout=30, socket_connect_timeout=5,
            health_check_interval=10, client_name=client_name))

    @classmethod
    def connect(cls, settings: Settings, client_name: str | None = None) -> Ledger:
        return cls.from_url(settings.redis_url, client_name, settings.redis_master_name)

    # Jobs

    def save_job(self, manifest: JobManifest) -> None:
        """Store the manifest. An incomplete one (enqueue still storing inputs) puts the job in
        `creating`; a complete one leaves the state as it is (`running` if it had none)."""
        now = time.time()
        with self.r.pipeline() as p:
            p.sadd(keys.JOBS, manifest.name)
            p.hset(keys.job(manifest.name), mapping={"manifest": manifest.to_json(), "updated": now})
            if manifest.complete:
                p.hsetnx(keys.job(manifest.name), "state", STATE_RUNNING)
                p.hsetnx(keys.job(manifest.name), "started_at", manifest.created_at)
            else:
                p.hset(keys.job(manifest.name), "state", STATE_CREATING)
            p.execute()

    def activate(self, manifest: JobManifest) -> None:
        """The last step of creating a job: its complete manifest, and `running` from now on."""
        if not manifest.complete:
            raise JobError(f"job {manifest.name}: cannot start a job whose inputs are incomplete")
        with self.r.pipeline() as p:
            p.hset(keys.job(manifest.name), mapping={
                "manifest": manifest.to_json(), "state": STATE_RUNNING, "reason": "",
                "started_at": time.time(), "updated": time.time()})
            p.execute()

    def load_job(self, name: str) -> JobManifest:
        raw = self.r.hget(keys.job(name), "manifest")
        if raw is None:
            raise JobError(f"no job named {name!r} in {self._where()}")
        return JobManifest.from_json(raw)

    def job_exists(self, name: str) -> bool:
        return bool(self.r.hexists(keys.job(name), "manifest"))

    def job_names(self) -> list[str]:
        return sorted(n.decode() for n in self.r.smembers(keys.JOBS))  # type: ignore[union-attr]

    def all_batches(self, name: str) -> list[str]:
        """The job's enqueued batches plus those made by `requeue --failed`."""
        manifest = self.load_job(name)
        extra = sorted(b.decode() for b in self.r.smembers(keys.job_part(name, "extra")))  # type: ignore[union-attr]
        return [keys.batch_id(i) for i in range(1, manifest.batches + 1)] + extra

    def job_state(self, name: str) -> tuple[str, str]:
        state, reason = self.r.hmget(keys.job(name), "state", "reason")
        return _text(state) or "running", _text(reason)

    def set_state(self, name: str, state: str, reason: str = "") -> None:
        if state not in JOB_STATES:
            raise JobError(f"unknown job state {state!r}")
        self.r.hset(
            keys.job(name), mapping={"state": state, "reason": reason, "updated": time.time()}
        )

    def _where(self) -> str:
        kw = self.r.connection_pool.connection_kwargs
        return f"redis {kw.get('host', kw.get('path', '?'))}:{kw.get('port', '')}"

    # Batches

    def mark_queued(self, name: str, batches: Iterable[str]) -> None:
        now = time.time()
        mapping = {b: now for b in batches}
        if mapping:
            self.r.zadd(keys.job_part(name, "queued"), mapping)

    def unqueue(self, name: str, batch: str) -> None:
        self.r.zrem(keys.job_part(name, "queued"), batch)

    def done_batches(self, name: str) -> set[str]:
        return {b.decode() for b in self.r.smembers(keys.job_part(name, "done"))}  # type: ignore[union-attr]

    def queued_batches(self, name: str) -> dict[str, float]:
        return self._scored(keys.job_part(name, "queued"))

    def running_batches(self, name: str) -> dict[str, float]:
        return self._scored(keys.job_part(name, "running"))

    def _scored(self, key: str) -> dict[str, float]:
        pairs: Any = self.r.zrange(key, 0, -1, withscores=True)
        return {member.decode(): float(score) for member, score in pairs}

    def is_done(self, name: str, batch: str) -> bool:
        return bool(self.r.sismember(keys.job_part(name, "done"), batch))

    # Leases

    def acquire(self, name: str, batch: str, token: str, ttl_s: float) -> int | None:
        """Take the batch's lease; returns the attempt number, or None if someone holds it."""
        if not self.r.set(keys.lease(name, batch), token, nx=True, px=int(ttl_s * 1000)):
            return None
        with self.r.pipeline() as p:
            p.hincrby(keys.job_part(name, "attempts"), batch, 1)
            p.zrem(keys.job_part(name, "queued"), batch)
            p.zadd(keys.job_part(name, "running"), {batch: time.time()})
            attempt = int(p.execute()[0])
        return attempt

    def release(self, name: str, batch: str, token: str, *, refund: bool) -> bool:
        """Give the lease back if `token` still holds it; True if it did.

        `refund` returns the attempt taken with the lease: the batch was handed back (pause,
        cancel, shutdown, server or sink down), so it must not count toward the batch's limit.
        """
        return bool(self._release(
            keys=[keys.lease(name, batch), keys.job_part(name, "attempts"),
                  keys.job_part(name, "running")],
            args=[token, "1" if refund else "0", batch]))

    def refund(self, name: str, batch: str) -> None:
        """Give back an attempt whose lease was lost while its worker lived (it noticed)."""
        self.r.hincrby(keys.job_part(name, "attempts"), batch, -1)

    def attempts(self, name: str, batch: str) -> int:
        """Attempts the batch has spent, counting one held right now."""
        return int(self.r.hget(keys.job_part(name, "attempts"), batch) or 0)

    def note_cause(self, name: str, batch: str, cause: str) -> None:
        """Why the batch's last attempt ended without finishing (kept for the limit's reason)."""
        self.r.hset(keys.job_part(name, "causes"), batch, cause)

    def last_cause(self, name: str, batch: str) -> str:
        return _text(self.r.hget(keys.job_part(name, "causes"), batch))

    def lease_alive(self, name: str, batch: str) -> bool:
        return bool(self.r.exists(keys.lease(name, batch)))

    def lease_token(self, name: str, batch: str) -> str | None:
        raw: Any = self.r.get(keys.lease(name, batch))
        return raw.decode() if raw is not None else None

    def break_lease(self, name: str, batch: str, token: str) -> bool:
        """Delete the lease if `token` still holds it (its owner is gone); True if deleted.
        The attempt stays spent: the worker died holding the batch."""
        return self.release(name, batch, token, refund=False)

    # Prompt-level checkpoints

    def load_checkpoint(self, name: str, batch: str) -> dict[str, dict[str, Any]]:
        raw = self.r.hgetall(keys.checkpoint(name, batch))
        return {k.decode(): orjson.loads(v) for k, v in raw.items()}  # type: ignore[union-attr]

    def drop_failures(self, name: str, batch: str,
                      failures: Iterable[dict[str, Any]]) -> int | None:
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
                  keys.job_part(name, "stats"), keys.job_part(name, "workers")], args=args))
        return None if taken < 0 else taken

    # Completion

    def finish_batch(
        self, name: str, batch: str, written: Mapping[str, float], worker: str,
        failures: list[bytes], bytes_written: int = 0, now: float | None = None,
    ) -> bool:
        """Record a batch whose objects are in the sink: done set and the written counters
        (`records.written_counts`), once per batch; drop its checkpoint. True if this call was
        the first to record it. `worker` is who wrote it ("" when rebuilt from the sink)."""
        args: list[Any] = [batch, time.time() if now is None else now, FAILURES_KEPT, len(written)]
        for field, value in written.items():
            args += [field, value]
        first = bool(self._finish(
            keys=[keys.job_part(name, "done"), keys.job_part(name, "running"),
                  keys.job_part(name, "queued"), keys.job_part(name, "written"), keys.job(name),
                  keys.checkpoint(name, batch), keys.job_part(name, "failures")],
            args=args + failures))
        if first:
            with self.r.pipeline(transaction=False) as p:
                p.hincrbyfloat(keys.job_part(name, "stats"), "batches_done", 1)
                p.hincrbyfloat(keys.job_part(name, "stats"), "bytes_written", bytes_written)
                if worker:
                    p.hincrbyfloat(keys.job_part(name, "workers"), f"{worker}|batches_done", 1)
                p.execute()
        return first

    def stats(self, name: str) -> dict[str, float]:
        """Live counters, moved by each prompt as it reaches the checkpoint."""
        return self._floats(keys.job_part(name, "stats"))

    def counts(self, name: str) -> tuple[dict[str, float], dict[str, float], int, int]:
        """Written counters, live counters, batches done and requeue batches, read in one
        transaction: a batch finishing between two reads would make a job look done with its
        last batch's prompts missing."""
        with self.r.pipeline(transaction=True) as p:
            p.hgetall(keys.job_part(name, "written"))
            p.hgetall(keys.job_part(name, "stats"))
            p.scard(keys.job_part(name, "done"))
            p.scard(keys.job_part(name, "extra"))
            written, stats, done, extra = p.execute()
        return _decoded(written), _decoded(stats), int(done), int(extra)

    def _floats(self, key: str) -> dict[str, float]:
        return _decoded(self.r.hgetall(key))


def _decoded(raw: Any) -> dict[str, float]:
    return {k.decode(): float(v) for k, v in raw.items()}


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value or "")

"""The Redis ledger: job manifests, batch states, leases, checkpoints and counters.

A batch moves `queued -> running -> done`; `running` means a worker holds its lease. The ledger
is bookkeeping for speed and visibility: the sink decides what is done, and `rebuild_done`
reconstructs the done set from it.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from typing import Any

import orjson
import redis

from workers import keys
from workers.errors import JobError
from workers.job import JobManifest

STATE_RUNNING = "running"
STATE_PAUSED = "paused"
STATE_CANCELLED = "cancelled"
JOB_STATES = (STATE_RUNNING, STATE_PAUSED, STATE_CANCELLED)
# Enough recent failure reasons to explain a bad job without growing without bound.
FAILURES_KEPT = 200

# Extends a lease only for its owner (the batch runner's heartbeat runs it on its loop).
RENEW_LEASE = """
if redis.call('get', KEYS[1]) == ARGV[1] then
  return redis.call('pexpire', KEYS[1], ARGV[2])
end
return 0
"""
_RELEASE = """
if redis.call('get', KEYS[1]) == ARGV[1] then
  return redis.call('del', KEYS[1])
end
return 0
"""


class Ledger:
    """Synchronous ledger operations on one Redis connection pool."""

    def __init__(self, client: redis.Redis) -> None:
        self.r = client
        self._release = client.register_script(_RELEASE)

    @classmethod
    def from_url(cls, url: str, client_name: str | None = None) -> Ledger:
        return cls(
            redis.Redis.from_url(
                url, socket_timeout=30, socket_connect_timeout=5, health_check_interval=10,
                client_name=client_name,
            )
        )

    # Jobs

    def save_job(self, manifest: JobManifest) -> None:
        now = time.time()
        with self.r.pipeline() as p:
            p.sadd(keys.JOBS, manifest.name)
            p.hset(keys.job(manifest.name), mapping={"manifest": manifest.to_json(), "updated": now})
            p.hsetnx(keys.job(manifest.name), "state", STATE_RUNNING)
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

    def release(self, name: str, batch: str, token: str, *, refund: bool = False) -> None:
        """Give the lease back; `refund` returns the attempt (the batch was not at fault)."""
        if self._release(keys=[keys.lease(name, batch)], args=[token]) and refund:
            self.r.hincrby(keys.job_part(name, "attempts"), batch, -1)
        self.r.zrem(keys.job_part(name, "running"), batch)

    def lease_alive(self, name: str, batch: str) -> bool:
        return bool(self.r.exists(keys.lease(name, batch)))

    def lease_token(self, name: str, batch: str) -> str | None:
        raw: Any = self.r.get(keys.lease(name, batch))
        return raw.decode() if raw is not None else None

    def break_lease(self, name: str, batch: str, token: str) -> bool:
        """Delete the lease if `token` still holds it (its owner is gone); True if deleted."""
        if not self._release(keys=[keys.lease(name, batch)], args=[token]):
            return False
        self.r.zrem(keys.job_part(name, "running"), batch)
        return True

    # Prompt-level checkpoints

    def load_checkpoint(self, name: str, batch: str) -> dict[str, dict[str, Any]]:
        raw = self.r.hgetall(keys.checkpoint(name, batch))
        return {k.decode(): orjson.loads(v) for k, v in raw.items()}  # type: ignore[union-attr]

    # Completion

    def finish_batch(
        self, name: str, batch: str, stats: Mapping[str, float], worker: str, failures: list[bytes]
    ) -> None:
        """Record a written batch: done set, counters, per-worker counters; drop its checkpoint."""
        with self.r.pipeline(transaction=True) as p:
            p.sadd(keys.job_part(name, "done"), batch)
            p.zrem(keys.job_part(name, "running"), batch)
            p.zrem(keys.job_part(name, "queued"), batch)
            for field, value in stats.items():
                p.hincrbyfloat(keys.job_part(name, "stats"), field, value)
                if field == "batches_done":
                    p.hincrbyfloat(keys.job_part(name, "workers"), f"{worker}|{field}", value)
            if failures:
                p.lpush(keys.job_part(name, "failures"), *failures)
                p.ltrim(keys.job_part(name, "failures"), 0, FAILURES_KEPT - 1)
            p.delete(keys.checkpoint(name, batch))
            p.execute()

    def stats(self, name: str) -> dict[str, float]:
        raw = self.r.hgetall(keys.job_part(name, "stats"))
        return {k.decode(): float(v) for k, v in raw.items()}  # type: ignore[union-attr]

    def rebuild_done(self, name: str, done_in_sink: Iterable[str]) -> int:
        """Make the done set match the sink (after a Redis loss); returns batches added."""
        batches = list(done_in_sink)
        if not batches:
            return 0
        return int(self.r.sadd(keys.job_part(name, "done"), *batches))


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value or "")

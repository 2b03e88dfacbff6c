"""Jobs: the job's hash (manifest, state, clock), the active and finished indexes, its lock,
and its keys' retention."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final, cast

import redis
from redis.lock import Lock

from fleetgen import keys
from fleetgen.errors import JobError, UnknownJobError
from fleetgen.job import JobManifest, JobState
from fleetgen.ledger._replies import members, script, text
from fleetgen.ledger._shards import Shards
from fleetgen.settings import JOB_RETENTION_S

# `creating`: enqueue is still storing batch inputs; no worker, reconciler or export acts on
# the job until enqueue sets it `running` (after the last input and the final manifest).
STATE_CREATING: Final = "creating"
STATE_RUNNING: Final = "running"
STATE_PAUSED: Final = "paused"
STATE_CANCELLED: Final = "cancelled"
JOB_STATES = (STATE_CREATING, STATE_RUNNING, STATE_PAUSED, STATE_CANCELLED)
# What `settle` found the job to be.
FINISHED, ACTIVE, GONE = "finished", "active", "gone"

# Files a job under the active or the finished jobs, its keys lasting or expiring to match.
_SETTLE = script("settle_job.lua")

# The job's lock (fleetgen/creation.py): redis-py's, taken with a token naming its holder.
JobLock = Lock


@dataclass(frozen=True)
class FinishedSummary:
    """A finished job's line in `producer jobs`."""

    state: str
    reason: str
    prompts: int  # the outcomes it asked for: its answers (one per prompt unless it asked more)
    prompts_done: int
    prompts_failed: int


@dataclass(frozen=True)
class JobTimes:
    """When the job started running (enqueue finished), when a batch of it was last written,
    and when its state last changed; 0.0 for what has not happened."""

    started: float
    last_write: float
    changed: float


class Jobs:
    """The jobs Redis holds: each one's hash (fg:job:{job}), the active set and the finished
    index, the job's lock, and when its keys expire."""

    def __init__(self, client: redis.Redis | Shards,
                 job_retention: float = JOB_RETENTION_S) -> None:
        self.shards = Shards.of(client)
        self.job_retention = job_retention
        self._settle = self.shards.fleet.register_script(_SETTLE)

    def save(self, manifest: JobManifest) -> None:
        """Store the manifest. An incomplete one (enqueue still storing inputs) puts the job in
        `creating`; a complete one leaves the state as it is (`running` if it had none)."""
        with self.shards.client(manifest.name).pipeline() as p:
            save_job(p, manifest)
            p.execute()

    def activate(self, manifest: JobManifest) -> None:
        """The last step of creating a job: its complete manifest, and `running` from now on."""
        if not manifest.complete:
            raise JobError(f"job {manifest.name}: cannot start a job whose inputs are incomplete")
        with self.shards.client(manifest.name).pipeline() as p:
            p.hset(keys.job(manifest.name), mapping={
                keys.JOB_MANIFEST: manifest.to_json(), keys.JOB_STATE: STATE_RUNNING,
                keys.JOB_REASON: "", keys.JOB_STARTED_AT: time.time(),
                keys.JOB_UPDATED: time.time()})
            p.execute()

    def load(self, name: str) -> JobManifest:
        raw = self.shards.client(name).hget(keys.job(name), keys.JOB_MANIFEST)
        if raw is None:
            # A process given no extra shard says which shard holds a job placed on one.
            raise self.shards.elsewhere(name) or UnknownJobError(
                f"no job named {name!r} in {self._where(name)} (`python -m producer jobs` "
                "lists them)", name)
        return JobManifest.from_json(raw)

    def exists(self, name: str) -> bool:
        return bool(self.shards.client(name).hexists(keys.job(name), keys.JOB_MANIFEST))

    def names(self) -> list[str]:
        """Every job Redis holds: the active ones and the finished ones not expired yet."""
        kept: list[str] = []
        for client, finished in self.shards.group(self.finished()):
            with client.pipeline(transaction=False) as p:
                for name in finished:
                    p.exists(keys.job(name))
                kept += [name for name, there in zip(finished, p.execute(), strict=True) if there]
        return sorted(set(self.active()) | set(kept))

    def active(self) -> list[str]:
        """Jobs not finished (creating, running, paused): what the reconciler walks."""
        found = self.shards.each(lambda r: members(r, keys.JOBS))
        return sorted(set().union(*found.values()))

    def finished(self, since: float = 0.0) -> dict[str, float]:
        """Finished jobs (done, cancelled) -> when they finished, those since `since`, oldest
        first. One whose keys expired may stay listed until the next job finishes."""
        found = self.shards.each(
            lambda r: r.zrangebyscore(keys.FINISHED_JOBS, since, "+inf", withscores=True))
        pairs: list[Any] = sorted((pair for shard in found.values() for pair in shard),
                                  key=lambda pair: pair[1])
        return {member.decode(): float(score) for member, score in pairs}

    def batches(self, name: str) -> list[str]:
        """The job's enqueued batches plus those made by `requeue --failed`."""
        manifest = self.load(name)
        extra = sorted(members(self.shards.client(name), keys.job_part(name, "extra")),
                       key=keys.batch_order)
        return [keys.batch_id(i) for i in range(1, manifest.batches + 1)] + extra

    def settle(self, name: str, now: float | None = None) -> str:
        """File the job under the active or the finished jobs by its state: FINISHED (cancelled,
        or running with every batch done, the job view's `done`), ACTIVE, or GONE (no such job).

        The one place a job's keys get their expiry: a finished job's keys and its unfinished
        batches' checkpoints (and rollout journals) expire `job_retention` after it first finished; a job that runs
        again (resume, `requeue --failed`) keeps them for good again. Idempotent: calling it
        again sets the same expiry. Called where a job may finish or start again (a batch
        recorded, a state set, batches queued) and by the reconciler for every active job."""
        now = time.time() if now is None else now
        raw: Any = self._settle(
            keys=[keys.JOBS, keys.FINISHED_JOBS, keys.job_part(name, "done"),
                  keys.job_part(name, "extra"), *keys.job_keys(name)],
            args=[name, repr(now), repr(float(self.job_retention))],
            client=self.shards.client(name))
        found: str = raw[0].decode()
        value = int(raw[1])
        # The job's placement (REDIS_URL's server) goes some time after its keys.
        if found == FINISHED:
            self.shards.expire(name, value, now)
        elif found == ACTIVE and value:
            self.shards.expire(name, None, now)
        if found == FINISHED or value:
            r = self.shards.client(name)
            unfinished = set(self.batches(name)) - members(r, keys.job_part(name, "done"))
            with r.pipeline(transaction=False) as p:
                for batch in unfinished:
                    for key in (keys.checkpoint(name, batch), keys.calls(name, batch)):
                        if found == FINISHED:
                            p.pexpireat(key, value)
                        else:
                            p.persist(key)
                p.execute()
        return found

    def state(self, name: str) -> tuple[JobState, str]:
        state, reason = self.shards.client(name).hmget(keys.job(name), keys.JOB_STATE,
                                                       keys.JOB_REASON)
        return cast(JobState, text(state) or STATE_RUNNING), text(reason)

    def set_state(self, name: str, state: JobState, reason: str = "") -> None:
        if state not in JOB_STATES:
            raise JobError(f"unknown job state {state!r}")
        self.shards.client(name).hset(keys.job(name), mapping={
            keys.JOB_STATE: state, keys.JOB_REASON: reason, keys.JOB_UPDATED: time.time()})
        self.settle(name)

    def times(self, name: str) -> JobTimes:
        started, last_write, changed = self.shards.client(name).hmget(
            keys.job(name), keys.JOB_STARTED_AT, keys.JOB_LAST_WRITE_AT, keys.JOB_UPDATED)
        return JobTimes(float(started or 0.0), float(last_write or 0.0), float(changed or 0.0))

    def inputs_stored(self, name: str) -> int:
        """Batch inputs a job still being created has stored, at its enqueue's last report."""
        return int(self.shards.client(name).hget(keys.job(name), keys.JOB_INPUTS_STORED) or 0)

    def note_inputs_stored(self, name: str, count: int | None) -> None:
        """How many batch inputs the enqueue has stored so far (None: the upload is over)."""
        if count is None:
            self.shards.client(name).hdel(keys.job(name), keys.JOB_INPUTS_STORED)
        else:
            self.shards.client(name).hset(keys.job(name), keys.JOB_INPUTS_STORED, count)

    def manifests_raw(self, names: Sequence[str]) -> list[bytes | None]:
        """The stored manifests of `names` (None where a job has none), in one round trip."""
        found: dict[str, bytes | None] = {}
        for client, group in self.shards.group(names):
            with client.pipeline(transaction=False) as p:
                for name in group:
                    p.hget(keys.job(name), keys.JOB_MANIFEST)
                found.update(zip(group, p.execute(), strict=True))
        return [found[name] for name in names]

    def finished_summaries(self, names: Sequence[str]) -> list[FinishedSummary | None]:
        """State, reason, prompts and what the sink holds of finished jobs, in one round trip;
        None for a job whose keys expired."""
        found: dict[str, FinishedSummary | None] = {}
        for client, group in self.shards.group(names):
            with client.pipeline(transaction=False) as p:
                for name in group:
                    p.hmget(keys.job(name), keys.JOB_MANIFEST, keys.JOB_STATE, keys.JOB_REASON)
                    p.hmget(keys.job_part(name, "written"), "prompts_done", "prompts_failed")
                replies = p.execute()
            for name, (manifest, state, reason), written in zip(
                    group, replies[::2], replies[1::2], strict=True):
                found[name] = None if manifest is None else FinishedSummary(
                    text(state), text(reason), JobManifest.from_json(manifest).answers,
                    int(float(written[0] or 0)), int(float(written[1] or 0)))
        return [found[name] for name in names]

    def lock(self, name: str, ttl_s: float) -> JobLock:
        """The job's lock (one command that changes the job's batches at a time), not taken."""
        lock: JobLock = self.shards.client(name).lock(keys.job_part(name, "enqueue"), timeout=ttl_s,
                                    blocking=False, thread_local=False)
        return lock

    def lock_token(self, name: str) -> bytes | None:
        raw = self.shards.client(name).get(keys.job_part(name, "enqueue"))
        return raw if isinstance(raw, bytes) else None

    def release_lock(self, name: str, token: bytes, ttl_s: float) -> None:
        """Release the job's lock if `token` still holds it (compare-and-delete); LockError if
        it changed hands."""
        lock = self.shards.client(name).lock(keys.job_part(name, "enqueue"), timeout=ttl_s)
        lock.do_release(token)

    def _where(self, name: str) -> str:
        kw = self.shards.client(name).connection_pool.connection_kwargs
        where = f"Redis at {kw.get('host', kw.get('path', '?'))}:{kw.get('port', '')}"
        return f"{where}, its ledger shard" if self.shards.several else where


def save_job(p: redis.client.Pipeline, manifest: JobManifest) -> None:
    """Queue on `p` the writes of `Jobs.save` (the rebuild makes them in its own transaction)."""
    now = time.time()
    job = keys.job(manifest.name)
    p.sadd(keys.JOBS, manifest.name)
    p.hset(job, mapping={keys.JOB_MANIFEST: manifest.to_json(), keys.JOB_UPDATED: now})
    if manifest.complete:
        p.hsetnx(job, keys.JOB_STATE, STATE_RUNNING)
        p.hsetnx(job, keys.JOB_STARTED_AT, manifest.created_at)
    else:
        p.hset(job, keys.JOB_STATE, STATE_CREATING)


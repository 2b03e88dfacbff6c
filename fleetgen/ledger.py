"""The Redis ledger: job manifests, batch states, leases, checkpoints and counters.

A batch moves `queued -> running -> done`; `running` means a worker holds its lease. The ledger
is bookkeeping for speed and visibility: the sink decides what is done, and `restore` puts back
what a reading of the sink found (producer/rebuild.py) when Redis lost it or it is in doubt.
A finished job (done or cancelled) leaves the active jobs for the finished index, and its keys
expire FLEETGEN_JOB_RETENTION after it finished (`settle`).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any, Final, cast

import orjson
import redis
from redis.lock import Lock

from fleetgen import keys, redisconn
from fleetgen.errors import JobError, UnknownJobError
from fleetgen.job import JobManifest, JobState
from fleetgen.records import FailureRecord, OutputRecord, read_record
from fleetgen.settings import JOB_RETENTION_S, REDIS_MASTER_NAME, Settings

# `creating`: enqueue is still storing batch inputs; no worker, reconciler or export acts on
# the job until enqueue sets it `running` (after the last input and the final manifest).
STATE_CREATING: Final = "creating"
STATE_RUNNING: Final = "running"
STATE_PAUSED: Final = "paused"
STATE_CANCELLED: Final = "cancelled"
JOB_STATES = (STATE_CREATING, STATE_RUNNING, STATE_PAUSED, STATE_CANCELLED)
# The job hash's field numbering `requeue --failed` rounds: the last round's number.
# Enough recent failure reasons to explain a bad job without growing without bound.
FAILURES_KEPT = 200

# The scripts live beside this module (package data: pyproject.toml); each file says what its
# KEYS and ARGV are.
# Extends a lease only for its owner (the batch runner's heartbeat runs it on its loop).
RENEW_LEASE = resources.files("fleetgen").joinpath("renew_lease.lua").read_text(encoding="utf-8")
# Gives a lease back if still held, refunding the attempt if asked.
_RELEASE = resources.files("fleetgen").joinpath("release_lease.lua").read_text(encoding="utf-8")
# Records a written batch once: only the first call counts its prompts.
_FINISH = resources.files("fleetgen").joinpath("finish_batch.lua").read_text(encoding="utf-8")
# Takes failures out of an unleased batch's checkpoint, with what they added to the counters.
_DROP_FAILURES = resources.files("fleetgen").joinpath("drop_failures.lua").read_text(
    encoding="utf-8")
# Files a job under the active or the finished jobs, its keys lasting or expiring to match.
_SETTLE = resources.files("fleetgen").joinpath("settle_job.lua").read_text(encoding="utf-8")
# What `settle` found the job to be.
FINISHED, ACTIVE, GONE = "finished", "active", "gone"


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


# What the job views read (fleetgen/jobview.py, fleetgen/progress.py, producer/report.py): the
# records the workers leave in the job's hash, decoded. Their field names are the JSON keys of
# `status --json` and progress.json.


@dataclass(frozen=True)
class JobTimes:
    """When the job started running (enqueue finished), when a batch of it was last written,
    and when its state last changed; 0.0 for what has not happened."""

    started: float
    last_write: float
    changed: float


@dataclass(frozen=True)
class EndVerdict:
    """The canary's judgement of a job smaller than its window, at the job's end
    (workers/quality.py): the answers it had, whether they were enough, what it found."""

    answers: int
    judged: bool
    verdict: str | None


@dataclass(frozen=True)
class CanaryProgress:
    """Answers the canary has judged so far, and its end-of-job verdict once there is one."""

    seen: int
    end: EndVerdict | None


@dataclass(frozen=True)
class QualityExample:
    """One answer that made the canary pause the job (fleetgen/canary.py `_examples`)."""

    id: str
    content: str
    output_tokens: int
    length: bool


@dataclass(frozen=True)
class QualityPause:
    """What the canary found when it paused the job, and whether the operator accepted it."""

    examples: list[QualityExample]
    detected_after: int
    accepted: bool


@dataclass(frozen=True)
class FailureExample:
    """One failure of the cause that tripped the failure breaker (fleetgen/breaker.py)."""

    id: str
    code: str
    message: str


class Ledger:
    """Synchronous ledger operations on one Redis connection pool."""

    def __init__(self, client: redis.Redis, job_retention: float = JOB_RETENTION_S) -> None:
        self.r = client
        self.job_retention = job_retention
        self._settle = client.register_script(_SETTLE)
        self._release = client.register_script(_RELEASE)
        self._finish = client.register_script(_FINISH)
        self._drop_failures = client.register_script(_DROP_FAILURES)

    @classmethod
    def from_url(cls, url: str, client_name: str | None = None,
                 master_name: str = REDIS_MASTER_NAME,
                 job_retention: float = JOB_RETENTION_S) -> Ledger:
        """A ledger on the Redis `url` names: a server, or the master of Sentinels."""
        return cls(redisconn.client(
            url, master_name, socket_timeout=30, socket_connect_timeout=5,
            health_check_interval=10, client_name=client_name), job_retention)

    @classmethod
    def connect(cls, settings: Settings, client_name: str | None = None) -> Ledger:
        return cls.from_url(settings.redis_url, client_name, settings.redis_master_name,
                            settings.job_retention)

    # Jobs

    def save_job(self, manifest: JobManifest) -> None:
        """Store the manifest. An incomplete one (enqueue still storing inputs) puts the job in
        `creating`; a complete one leaves the state as it is (`running` if it had none)."""
        with self.r.pipeline() as p:
            _save_job(p, manifest)
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
            raise UnknownJobError(f"no job named {name!r} in {self._where()} (`python -m producer "
                                  "jobs` lists them)", name)
        return JobManifest.from_json(raw)

    def job_exists(self, name: str) -> bool:
        return bool(self.r.hexists(keys.job(name), "manifest"))

    def job_names(self) -> list[str]:
        """Every job Redis holds: the active ones and the finished ones not expired yet."""
        finished = list(self.finished_jobs())
        with self.r.pipeline(transaction=False) as p:
            for name in finished:
                p.exists(keys.job(name))
            kept = [name for name, there in zip(finished, p.execute(), strict=True) if there]
        return sorted(set(self.active_job_names()) | set(kept))

    def active_job_names(self) -> list[str]:
        """Jobs not finished (creating, running, paused): what the reconciler walks."""
        return sorted(n.decode() for n in self.r.smembers(keys.JOBS))  # type: ignore[union-attr]

    def finished_jobs(self, since: float = 0.0) -> dict[str, float]:
        """Finished jobs (done, cancelled) -> when they finished, those since `since`, oldest
        first. One whose keys expired may stay listed until the next job finishes."""
        pairs: Any = self.r.zrangebyscore(keys.FINISHED_JOBS, since, "+inf", withscores=True)
        return {member.decode(): float(score) for member, score in pairs}

    def settle(self, name: str, now: float | None = None) -> str:
        """File the job under the active or the finished jobs by its state: FINISHED (cancelled,
        or running with every batch done, the job view's `done`), ACTIVE, or GONE (no such job).

        The one place a job's keys get their expiry: a finished job's keys and its unfinished
        batches' checkpoints expire `job_retention` after it first finished; a job that runs
        again (resume, `requeue --failed`) keeps them for good again. Idempotent: calling it
        again sets the same expiry. Called where a job may finish or start again (a batch
        recorded, a state set, batches queued) and by the reconciler for every active job."""
        now = time.time() if now is None else now
        raw: Any = self._settle(
            keys=[keys.JOBS, keys.FINISHED_JOBS, keys.job_part(name, "done"),
                  keys.job_part(name, "extra"), *keys.job_keys(name)],
            args=[name, repr(now), repr(float(self.job_retention))])
        found: str = raw[0].decode()
        value = int(raw[1])
        if found == FINISHED or value:
            with self.r.pipeline(transaction=False) as p:
                for batch in set(self.all_batches(name)) - self.done_batches(name):
                    if found == FINISHED:
                        p.pexpireat(keys.checkpoint(name, batch), value)
                    else:
                        p.persist(keys.checkpoint(name, batch))
                p.execute()
        return found

    def all_batches(self, name: str) -> list[str]:
        """The job's enqueued batches plus those made by `requeue --failed`."""
        manifest = self.load_job(name)
        extra = sorted((b.decode() for b in self.r.smembers(keys.job_part(name, "extra"))),  # type: ignore[union-attr]
                       key=keys.batch_order)
        return [keys.batch_id(i) for i in range(1, manifest.batches + 1)] + extra

    def job_state(self, name: str) -> tuple[JobState, str]:
        state, reason = self.r.hmget(keys.job(name), "state", "reason")
        return cast(JobState, _text(state) or STATE_RUNNING), _text(reason)

    def set_state(self, name: str, state: JobState, reason: str = "") -> None:
        if state not in JOB_STATES:
            raise JobError(f"unknown job state {state!r}")
        self.r.hset(
            keys.job(name), mapping={"state": state, "reason": reason, "updated": time.time()}
        )
        self.settle(name)

    def _where(self) -> str:
        kw = self.r.connection_pool.connection_kwargs
        return f"Redis at {kw.get('host', kw.get('path', '?'))}:{kw.get('port', '')}"

    # Batches

    def mark_queued(self, name: str, batches: Iterable[str]) -> None:
        now = time.time()
        mapping = {b: now for b in batches}
        if mapping:
            self.r.zadd(keys.job_part(name, "queued"), mapping)
            # Work queued for a finished job (`requeue --failed` of a done one) runs it again.
            self.settle(name)

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

    def load_checkpoint(self, name: str, batch: str) -> dict[str, OutputRecord]:
        raw = self.r.hgetall(keys.checkpoint(name, batch))
        return {k.decode(): read_record(v) for k, v in raw.items()}  # type: ignore[union-attr]

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
            # Its last batch finishes the job.
            self.settle(name)
        return first

    # Requeue rounds and the ledger rebuilt from the sink

    def next_round(self, name: str, after: int) -> int:
        """Number the job's next requeue round: one past its last in the ledger and `after`
        (the last the sink holds), so a round name is never used twice. The caller holds the
        job's lock (fleetgen/creation.py)."""
        last = int(self.r.hget(keys.job(name), keys.JOB_ROUNDS) or 0)
        number = max(last, after) + 1
        self.r.hset(keys.job(name), keys.JOB_ROUNDS, number)
        return number

    def record_round(self, name: str, batches: list[str], failed_by_code: Mapping[str, int]) -> None:
        """Add a requeue round's batches to the job, their prompts out of the failed figures
        until the new batches are written; live and written counters move together, so
        `checkpointed` stays right."""
        requeued = sum(failed_by_code.values())
        with self.r.pipeline() as p:
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
        as it is. The caller holds the job's lock."""
        name = manifest.name
        stats = keys.job_part(name, "stats")
        # Codes and finish reasons the reading did not find must not linger at their old value.
        fields: list[bytes] = self.r.hkeys(stats)  # type: ignore[assignment]
        stale = [f for f in fields if f.startswith((b"error_", b"finish_"))]
        last = int(self.r.hget(keys.job(name), keys.JOB_ROUNDS) or 0)
        done, rounds = list(done), list(rounds)
        counted: dict[Any, float] = dict(written)
        tallied: dict[Any, float] = dict(live)
        with self.r.pipeline() as p:
            _save_job(p, manifest)
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

    # The job views: what `status`, progress.json and the report read

    def running_holds(self, name: str, batches: Iterable[str]) -> dict[str, tuple[str | None, int]]:
        """Batch -> the worker holding its lease (None when no lease is alive) and the prompts
        checkpointed in it so far, read in one round trip."""
        batches = list(batches)
        with self.r.pipeline(transaction=False) as p:
            for batch in batches:
                p.get(keys.lease(name, batch))
                p.hlen(keys.checkpoint(name, batch))
            raw = p.execute()
        return {batch: (keys.lease_owner(token.decode()) if token is not None else None, int(n))
                for batch, token, n in zip(batches, raw[::2], raw[1::2], strict=True)}

    def minutes(self, name: str) -> dict[int, dict[str, float]]:
        """Unix minute -> prompts finished (`prompts`) and output tokens written (`tokens`)."""
        out: dict[int, dict[str, float]] = {}
        raw: dict[bytes, bytes] = self.r.hgetall(keys.job_part(name, "minutes"))  # type: ignore[assignment]
        for k, v in raw.items():
            minute, _, kind = k.decode().partition("|")
            slot = out.setdefault(int(minute), {"prompts": 0.0, "tokens": 0.0})
            slot["tokens" if kind == "tokens" else "prompts"] += float(v)
        return out

    def worker_minutes(self, name: str) -> dict[str, dict[int, dict[str, float]]]:
        """Worker -> unix minute -> `prompts` and `tokens` it finished in that minute."""
        out: dict[str, dict[int, dict[str, float]]] = {}
        raw: dict[bytes, bytes] = self.r.hgetall(keys.job_part(name, "worker_minutes"))  # type: ignore[assignment]
        for k, v in raw.items():
            worker, minute, kind = k.decode().rsplit("|", 2)
            slot = out.setdefault(worker, {}).setdefault(int(minute), {"prompts": 0.0, "tokens": 0.0})
            slot[kind] += float(v)
        return out

    def worker_counters(self, name: str) -> dict[str, dict[str, float]]:
        """Worker -> the job's counters it moved (prompts_done, prompts_failed, output_tokens,
        batches_done): only those it moved, as the workers record them."""
        out: dict[str, dict[str, float]] = {}
        raw: dict[bytes, bytes] = self.r.hgetall(keys.job_part(name, "workers"))  # type: ignore[assignment]
        for k, v in raw.items():
            worker, _, counter = k.decode().partition("|")
            out.setdefault(worker, {})[counter] = float(v)
        return out

    def job_times(self, name: str) -> JobTimes:
        started, last_write, changed = self.r.hmget(
            keys.job(name), keys.JOB_STARTED_AT, keys.JOB_LAST_WRITE_AT, keys.JOB_UPDATED)
        return JobTimes(float(started or 0.0), float(last_write or 0.0), float(changed or 0.0))

    def inputs_stored(self, name: str) -> int:
        """Batch inputs a job still being created has stored, at its enqueue's last report."""
        return int(self.r.hget(keys.job(name), keys.JOB_INPUTS_STORED) or 0)

    def canary_progress(self, name: str) -> CanaryProgress:
        seen, end = self.r.hmget(keys.job(name), keys.JOB_CANARY_SEEN, keys.JOB_CANARY_END)
        return CanaryProgress(int(seen or 0), EndVerdict(**orjson.loads(end)) if end else None)

    def quality_pause(self, name: str) -> QualityPause | None:
        """What the canary found when it paused the job; None if it never did."""
        examples, seen, accepted = self.r.hmget(
            keys.job(name), keys.JOB_QUALITY_EXAMPLES, keys.JOB_QUALITY_SEEN,
            keys.JOB_QUALITY_ACCEPTED)
        if examples is None:
            return None
        return QualityPause([QualityExample(**e) for e in orjson.loads(examples)], int(seen or 0),
                            accepted is not None)

    def breaker_trip(self, name: str) -> tuple[str | None, FailureExample | None]:
        """The cause that tripped the failure breaker and one failure of it (None, None while
        it holds no trip)."""
        cause, example = self.r.hmget(
            keys.job(name), keys.JOB_BREAKER_CAUSE, keys.JOB_BREAKER_EXAMPLE)
        return (_text(cause) if cause is not None else None,
                FailureExample(**orjson.loads(example)) if example else None)

    def worker_registry(self) -> dict[str, bytes]:
        """Worker -> its registry entry as it wrote it (JSON: fleetgen/fleet.py `WorkerEntry`)."""
        raw: dict[bytes, bytes] = self.r.hgetall(keys.WORKERS)  # type: ignore[assignment]
        return {name.decode(): entry for name, entry in raw.items()}

    def claim_progress_turn(self, name: str, now: float, every_s: int) -> bool:
        """True for the first caller in each `every_s` window: it writes the job's progress.json."""
        return bool(self.r.set(keys.job_part(name, "progress_due"), now, nx=True, ex=every_s))

    def progress_mark(self, name: str) -> bytes | None:
        """What the job's last progress.json said, as `set_progress_mark` stored it."""
        raw = self.r.get(keys.job_part(name, "progress_mark"))
        return raw if isinstance(raw, bytes) else None

    def set_progress_mark(self, name: str, mark: bytes) -> None:
        self.r.set(keys.job_part(name, "progress_mark"), mark)

    # The producer's commands: breaker and quality settlements, the input upload's progress,
    # the job locks, rebuilt tallies, the finished jobs' table

    def breaker_cause(self, name: str) -> str | None:
        """The failure cause that paused the job (the breaker's), or None."""
        raw = self.r.hget(keys.job(name), keys.JOB_BREAKER_CAUSE)
        return raw.decode() if isinstance(raw, bytes) else None

    def accepted_causes_raw(self, name: str) -> bytes | None:
        """The JSON list of failure causes the operator accepted for the job, as stored."""
        raw = self.r.hget(keys.job(name), keys.JOB_BREAKER_ACCEPTED)
        return raw if isinstance(raw, bytes) else None

    def accept_causes(self, name: str, causes: Iterable[str]) -> None:
        self.r.hset(keys.job(name), keys.JOB_BREAKER_ACCEPTED, orjson.dumps(sorted(causes)))

    def accept_quality(self, name: str, now: float) -> None:
        self.r.hset(keys.job(name), keys.JOB_QUALITY_ACCEPTED, now)

    def clear_breaker_window(self, name: str) -> None:
        """Forget the outcomes the breaker judged and the cause it paused on: a fresh window."""
        with self.r.pipeline() as p:
            p.delete(keys.job_part(name, "outcomes"))
            p.hdel(keys.job(name), keys.JOB_BREAKER_CAUSE, keys.JOB_BREAKER_EXAMPLE)
            p.execute()

    def note_inputs_stored(self, name: str, count: int | None) -> None:
        """How many batch inputs the enqueue has stored so far (None: the upload is over)."""
        if count is None:
            self.r.hdel(keys.job(name), keys.JOB_INPUTS_STORED)
        else:
            self.r.hset(keys.job(name), keys.JOB_INPUTS_STORED, count)

    def job_lock(self, name: str, ttl_s: float) -> JobLock:
        """The job's lock (one command that changes the job's batches at a time), not taken."""
        lock: JobLock = self.r.lock(keys.job_part(name, "enqueue"), timeout=ttl_s, blocking=False,
                                 thread_local=False)
        return lock

    def job_lock_token(self, name: str) -> bytes | None:
        raw = self.r.get(keys.job_part(name, "enqueue"))
        return raw if isinstance(raw, bytes) else None

    def release_job_lock(self, name: str, token: bytes, ttl_s: float) -> None:
        """Release the job's lock if `token` still holds it (compare-and-delete); LockError if
        it changed hands."""
        self.r.lock(keys.job_part(name, "enqueue"), timeout=ttl_s).do_release(token)

    def manifests_raw(self, names: Sequence[str]) -> list[bytes | None]:
        """The stored manifests of `names` (None where a job has none), in one round trip."""
        with self.r.pipeline(transaction=False) as p:
            for name in names:
                p.hget(keys.job(name), keys.JOB_MANIFEST)
            return list(p.execute())

    def checkpointed_records(self, name: str, batches: Iterable[str]) -> Iterator[bytes]:
        """Every checkpointed record (raw JSON) of the given batches, read in one round trip."""
        with self.r.pipeline(transaction=False) as p:
            for batch in batches:
                p.hvals(keys.checkpoint(name, batch))
            for records in p.execute():
                yield from records

    def finished_summaries(self, names: Sequence[str]) -> list[FinishedSummary | None]:
        """State, reason, prompts and what the sink holds of finished jobs, in one round trip;
        None for a job whose keys expired."""
        with self.r.pipeline(transaction=False) as p:
            for name in names:
                p.hmget(keys.job(name), keys.JOB_MANIFEST, keys.JOB_STATE, keys.JOB_REASON)
                p.hmget(keys.job_part(name, "written"), "prompts_done", "prompts_failed")
            replies = p.execute()
        out: list[FinishedSummary | None] = []
        for (manifest, state, reason), written in zip(replies[::2], replies[1::2], strict=True):
            out.append(None if manifest is None else FinishedSummary(
                _text(state), _text(reason), JobManifest.from_json(manifest).answers,
                int(float(written[0] or 0)), int(float(written[1] or 0))))
        return out

    # The reconciler's turn, its ownerless leases, the workers' connections, the broker

    def take_reconciler_turn(self, owner: str, ttl_ms: int) -> bool:
        """Whether this reconciler runs the round (one at a time over the whole fleet)."""
        return bool(self.r.set(keys.RECONCILER_LOCK, owner, nx=True, px=ttl_ms))

    def ownerless_leases(self) -> set[str]:
        """Leases whose owner had no Redis connection in the last round."""
        return {raw.decode() for raw in self.r.smembers(keys.OWNERLESS)}  # type: ignore[union-attr]

    def set_ownerless_leases(self, leases: set[str], ttl_ms: int) -> None:
        with self.r.pipeline() as p:
            p.delete(keys.OWNERLESS)
            if leases:
                p.sadd(keys.OWNERLESS, *leases)
                p.pexpire(keys.OWNERLESS, ttl_ms)
            p.execute()

    def drop_running(self, name: str, batch: str) -> None:
        """Take a batch whose worker is gone out of `running`, before it is dispatched again."""
        self.r.zrem(keys.job_part(name, "running"), batch)

    def client_names(self) -> set[str] | None:
        """The names of every open Redis connection; None where this Redis refuses CLIENT LIST
        (some managed services)."""
        try:
            clients: list[dict[str, Any]] = self.r.client_list()
        except redis.ResponseError:
            return None
        return {str(c.get("name") or "") for c in clients}

    def registered_workers(self) -> list[str]:
        """The name of every worker in the registry."""
        return [name.decode() for name in self.r.hkeys(keys.WORKERS)]  # type: ignore[union-attr]

    def broker_batches(self, *, grace_s: float) -> set[tuple[str, str]]:
        """(job, batch) of every message waiting in a queue list or held unacked by a worker.

        An unacked message delivered more than `grace_s` ago whose batch has no lease belongs to
        a worker that died between taking it and leasing it; it does not count as waiting.
        Only kombu's JSON envelope is read (`headers.id`, the task id), never the body, so the
        task serializer does not matter; the layout does (see the kombu pin in pyproject.toml).
        """
        found: set[tuple[str, str]] = set()
        for name in self.r.scan_iter(match="*", count=1000, _type="list"):
            for raw in self.r.lrange(name, 0, -1):
                _collect_task(found, raw)
        now = time.time()
        indexed: list[tuple[bytes, float]] = self.r.zrange(  # type: ignore[assignment]
            keys.BROKER_UNACKED_INDEX, 0, -1, withscores=True)
        recent = {tag for tag, score in indexed if now - score < grace_s}
        unacked: dict[bytes, bytes] = self.r.hgetall(keys.BROKER_UNACKED)  # type: ignore[assignment]
        for tag, raw in unacked.items():
            if tag not in recent:
                continue
            try:
                _collect_task(found, orjson.dumps(orjson.loads(raw)[0]))
            except (orjson.JSONDecodeError, IndexError, TypeError):
                continue
        return found

    # The worker's start checks (workers/preflight.py)

    def check_worker_access(self) -> None:
        """Ping, then read the registry as every batch does first; raises what Redis answers
        when it is out of reach, refuses the password or the user's ACL denies a command."""
        self.r.ping()
        self.r.hlen(keys.WORKERS)

    def worker_entry(self, worker: str) -> bytes | None:
        """The registry entry (JSON) last published under the worker name `worker`, or None."""
        raw = self.r.hget(keys.WORKERS, worker)
        return raw if isinstance(raw, bytes) else None

    def close(self) -> None:
        """Close the connection pool (a short-lived ledger, such as the start checks')."""
        self.r.close()


def _save_job(p: redis.client.Pipeline, manifest: JobManifest) -> None:
    now = time.time()
    p.sadd(keys.JOBS, manifest.name)
    p.hset(keys.job(manifest.name), mapping={"manifest": manifest.to_json(), "updated": now})
    if manifest.complete:
        p.hsetnx(keys.job(manifest.name), "state", STATE_RUNNING)
        p.hsetnx(keys.job(manifest.name), "started_at", manifest.created_at)
    else:
        p.hset(keys.job(manifest.name), "state", STATE_CREATING)


def _decoded(raw: Any) -> dict[str, float]:
    return {k.decode(): float(v) for k, v in raw.items()}


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value or "")


def _collect_task(found: set[tuple[str, str]], raw: Any) -> None:
    """Add the (job, batch) of a kombu message envelope's task id, if it is one of ours."""
    try:
        message = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return
    task_id = (message.get("headers") or {}).get("id") if isinstance(message, dict) else None
    parsed = keys.parse_task_id(task_id) if isinstance(task_id, str) else None
    if parsed:
        found.add(parsed)

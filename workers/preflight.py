"""What a worker checks before it takes work, so a misconfigured one says so instead of
consuming batches it can only fail.

At start (`check_start`, from the worker's setup signal): it can tell its server (one `gpuN`
queue or FLEETGEN_SERVER_URL), Redis answers with its credentials, and no live worker runs under its
name. Any failure ends the process with one `error:` line (`refuse`).

Per job (`SinkChecks`, in the batch runner): before its first batch of a job, the worker
writes, reads back and lists `{job}/.fleetgen/write-check/{worker}` in the job's output with its
own credentials, the operations its batches need under the job's prefix. A job whose output it
cannot use is blocked in this worker for `FLEETGEN_SINK_RECHECK_S`: its batches go back to the
queue unstarted (no attempt spent) for other workers, and the check runs again after that
time, so a fixed credential or bucket policy brings the worker back.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import NoReturn

import orjson

from fleetgen import keys, redisconn
from fleetgen.errors import FleetgenError, PreflightError, SinkError, SinkUnusableError
from fleetgen.fleet import LOST_AFTER_S, WorkerEntry
from fleetgen.ledger import Ledger
from fleetgen.poll import poll
from fleetgen.redact import redact
from fleetgen.retry import (
    REDIS_ERRORS,
    RedisAuthError,
    RedisNoPermissionError,
    RedisProtocolError,
)
from fleetgen.settings import Settings
from fleetgen.sink import Sink

log = logging.getLogger(__name__)

# A worker started together with its Redis (Procfile, compose) waits this long for it.
REDIS_START_WAIT_S = 15.0
EXIT_CONFIG = 78  # EX_CONFIG: the worker's configuration is wrong; restarting will not help


def refuse(message: str) -> NoReturn:
    """End the worker process with one `error:` line (stderr, then the log)."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    log.critical("worker refused to start: %s", message)
    raise SystemExit(EXIT_CONFIG)


def check_start(settings: Settings, worker: str, server_url: Callable[[], str]) -> str:
    """Run the start checks; return the worker's server URL, or raise PreflightError."""
    try:
        url = server_url()
    except FleetgenError as exc:
        raise PreflightError(f"worker {worker}: {exc}") from None
    ledger = Ledger(redisconn.client(settings.redis_url, settings.redis_master_name,
                                     socket_timeout=10, socket_connect_timeout=5))
    try:
        _check_redis(ledger, settings)
        holder = name_holder(ledger, worker)
    finally:
        ledger.close()
    if holder is not None:
        raise PreflightError(
            f"worker name {worker} is taken by a live worker on host {holder.host} "
            f"(pid {holder.pid}); stop it, or start this one with another name "
            f"(-n gpuN@%h)")
    return url


def _check_redis(ledger: Ledger, settings: Settings) -> None:
    where = redact(settings.redis_url)
    unreachable: list[BaseException] = []

    def reached() -> bool | None:
        try:
            ledger.registry.check_access()
            return True
        except RedisAuthError as exc:
            raise PreflightError(redisconn.auth_refused(settings.redis_url, exc)) from None
        except RedisNoPermissionError as exc:
            raise PreflightError(f"the Redis user of {where} may not do what a worker needs "
                                 f"({exc}); see the worker's ACL in docs/security.md") from None
        except RedisProtocolError as exc:
            raise PreflightError(redisconn.not_redis(settings.redis_url, exc)) from None
        except REDIS_ERRORS as exc:
            unreachable[:] = [exc]
            return None

    if poll(reached, REDIS_START_WAIT_S, interval_s=0.5) is None:
        raise PreflightError(
            f"cannot reach Redis at {where} ({redact(unreachable[0])}) after "
            f"{REDIS_START_WAIT_S:.0f}s; start it (`python -m launcher redis`) or set "
            "REDIS_URL") from None


def name_holder(ledger: Ledger, worker: str, now: float | None = None) -> WorkerEntry | None:
    """The registry entry of a live worker registered as `worker`, or None.

    Live means a fresh entry and, where Redis lets us list clients, an open connection named
    for that worker: a worker killed a second ago left a fresh entry but no connection (the
    kernel closed them), so its restart under the same name is not refused.
    """
    raw = ledger.registry.entry(worker)
    if raw is None:
        return None
    try:
        entry = WorkerEntry.from_json(raw)
    except ValueError:  # orjson's decode error is one too
        return None
    now = time.time() if now is None else now
    if now - entry.updated > LOST_AFTER_S:
        return None
    names = ledger.registry.client_names()
    if names is None:  # CLIENT LIST not allowed for this user: trust the entry
        return entry
    return entry if keys.worker_client(worker) in names else None


@dataclass
class _Blocked:
    error: str
    until: float


class SinkChecks:
    """Per job, whether this worker may use its output; thread-safe (pool threads share it)."""

    def __init__(self, worker: str, recheck_s: float) -> None:
        self.worker = worker
        self.recheck_s = recheck_s
        self._ok: set[str] = set()
        self._blocked: dict[str, _Blocked] = {}
        self._lock = threading.Lock()
        # One check per job at a time: other threads wait for its verdict.
        self._job_locks: dict[str, threading.Lock] = {}

    def require(self, job: str, open_sink: Callable[[], Sink]) -> Sink:
        """The job's sink, checked once (again after `recheck_s` if it failed); raises
        SinkUnusableError while the job is blocked in this worker."""
        with self._lock:
            job_lock = self._job_locks.setdefault(job, threading.Lock())
        with job_lock:
            if job not in self._ok:
                blocked = self._blocked.get(job)
                if blocked is not None and time.monotonic() < blocked.until:
                    raise SinkUnusableError(blocked.error)
                try:
                    write_check(open_sink(), job, self.worker)
                except SinkError as exc:
                    error = (f"cannot use the output of job {job} with this worker's "
                             f"credentials: {exc}")
                    self._blocked[job] = _Blocked(error, time.monotonic() + self.recheck_s)
                    log.error("worker %s: %s; not taking its batches for %.0fs", self.worker,
                              error, self.recheck_s)
                    raise SinkUnusableError(error) from None
                if job in self._blocked:
                    log.warning("worker %s: output of job %s usable again", self.worker, job)
                self._blocked.pop(job, None)
                self._ok.add(job)
        return open_sink()


def write_check(sink: Sink, job: str, worker: str) -> None:
    """Write, read back and list under the job's prefix, as its batches will; SinkError if any
    of them fails (a policy may allow one and deny another)."""
    prefix = f"{job}/.fleetgen/write-check/"
    key = prefix + worker
    body = orjson.dumps({"worker": worker, "at": time.time()})
    sink.put(key, body)
    if sink.get(key) != body:
        raise SinkError(f"{sink.describe(key)}: written, but reading it back gave other bytes")
    if key not in set(sink.list_keys(prefix)):
        raise SinkError(f"{sink.describe(prefix)}: listing does not show {key} just written")

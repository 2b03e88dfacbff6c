"""One command at a time changes what a job is: the job's lock, and who holds it.

`producer enqueue` holds it while it creates or resumes a job, `requeue --failed` (and `resume`
after a failure breaker pause) while it reads the job's failures and records a new round, and
`rebuild` while it rewrites the ledger from the sink: two of them at once would requeue the same
prompts twice, or count a round the other is recording. The job view (fleetgen/jobview.py) names
the holder of a job still `creating`. The lock is redis-py's, with a `host:pid:nonce:command`
token so a holder killed on this host (kill -9) is seen as gone at once; one killed on another
host is waited out (LOCK_TTL_S).

    with job_lock(ledger, "distill-v1", "requeue", wait_s=JOB_LOCK_WAIT_S):
        ...  # read the failures, record the round
    with creation_lock(ledger, "distill-v1"):  # enqueue's: never waits
        ...  # store inputs, activate the job
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

from tenacity import RetryError, Retrying, retry_if_result, stop_before_delay

from fleetgen.errors import JobBusyError
from fleetgen.ledger import JobLock, Ledger
from fleetgen.retry import REDIS_ERRORS, RedisLockError, backoff

log = logging.getLogger(__name__)

# The lock outlives a killed holder by at most this long; a live one renews it every third of
# it, so a slow sink cannot make it lapse.
LOCK_TTL_S = 30.0
# How long a requeue or a rebuild waits for the command holding the job's lock: a requeue reads
# a 100,000-prompt job's outcomes in seconds, and a holder killed elsewhere lapses in LOCK_TTL_S.
JOB_LOCK_WAIT_S = 2 * LOCK_TTL_S

# The command name enqueue holds the lock under.
ENQUEUE = "enqueue"


@contextmanager
def job_lock(ledger: Ledger, job: str, command: str, *, wait_s: float = 0.0) -> Iterator[None]:
    """Hold the job's lock for the block; JobBusyError if another command still holds it after
    `wait_s` seconds (0: at once)."""
    token = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}:{command}"
    lock = ledger.jobs.lock(job, LOCK_TTL_S)
    _acquire(ledger, lock, job, token, command, wait_s)
    stop = threading.Event()

    def renew() -> None:
        while not stop.wait(LOCK_TTL_S / 3):
            try:
                lock.reacquire()
            except RedisLockError:
                log.error("job %s: the %s lost the job's lock", job, command)
                return
            except REDIS_ERRORS as exc:  # a Redis blip: the next round tries again
                log.info("job %s: the job's lock not renewed (%s)", job, exc)

    renewer = threading.Thread(target=renew, name=f"fleetgen-{command}-lock", daemon=True)
    renewer.start()
    try:
        yield
    finally:
        stop.set()
        renewer.join()
        # Expired meanwhile: nobody else can have changed the job without it.
        with contextlib.suppress(RedisLockError):
            lock.release()


def creation_lock(ledger: Ledger, job: str) -> contextlib.AbstractContextManager[None]:
    """The job's lock as enqueue takes it: at once or JobBusyError, never waiting (a second
    enqueue of a job being created says so instead of uploading after the first)."""
    return job_lock(ledger, job, ENQUEUE)


def _acquire(ledger: Ledger, lock: JobLock, job: str, token: str, command: str,
             wait_s: float) -> None:
    def take() -> bool:
        if lock.acquire(token=token):
            return True
        # A holder killed on this host is gone now: its lock goes, and the next take decides.
        return _held(ledger, job, clear_stale=True) is None and bool(lock.acquire(token=token))

    if take():
        return
    held = _held(ledger, job)
    if wait_s > 0:
        log.info("job %s: the %s waits for the job's lock (%s holds it)", job, command,
                 _describe(held))
        try:
            Retrying(retry=retry_if_result(lambda got: not got), stop=stop_before_delay(wait_s),
                     wait=backoff(0.1, 1.0))(take)
            return
        except RetryError:
            held = _held(ledger, job)
    who, by = held or ("?", "?")
    if by == ENQUEUE and command == ENQUEUE:
        text = f"job {job} is being created by another enqueue (host:pid {who})"
    else:
        text = f"job {job} is busy: {_describe(held)} holds its lock"
    if wait_s > 0:
        text += f" after {wait_s:.0f}s"
    raise JobBusyError(f"{text}; wait for it, or if it was killed on another host, run this "
                       f"again in {LOCK_TTL_S:.0f}s")


def _describe(held: tuple[str, str] | None) -> str:
    return f"a {held[1]} (host:pid {held[0]})" if held else "another command"


def creation_holder(ledger: Ledger, job: str, *, clear_stale: bool = False) -> str | None:
    """`host:pid` of the command holding the job's lock, or None. A holder on this host whose
    process is gone (kill -9) counts as none; `clear_stale` also removes its lock then."""
    held = _held(ledger, job, clear_stale=clear_stale)
    return held[0] if held else None


def _held(ledger: Ledger, job: str, *, clear_stale: bool = False) -> tuple[str, str] | None:
    """(`host:pid`, command) of the lock's live holder, or None."""
    raw = ledger.jobs.lock_token(job)
    if raw is None:
        return None
    host, _, rest = raw.decode().partition(":")
    pid, _, rest = rest.partition(":")
    command = rest.partition(":")[2]
    if host != socket.gethostname() or not pid.isdigit() or _alive(int(pid)):
        return f"{host}:{pid}", command
    if clear_stale:
        # redis-py's compare-and-delete: only if the dead holder still has it (if it changed
        # hands meanwhile, the caller's next acquire decides).
        with contextlib.suppress(RedisLockError):
            ledger.jobs.release_lock(job, raw, LOCK_TTL_S)
    return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True

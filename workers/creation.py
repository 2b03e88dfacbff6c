"""One enqueue per job at a time: the job's creation lock, and who holds it.

`producer enqueue` holds the lock while it creates or resumes a job; the job view
(workers/jobview.py) names its holder for a job still `creating`. The lock is redis-py's, with a
`host:pid:nonce` token so a holder killed on this host (kill -9) is seen as gone at once; one
killed on another host is waited out (LOCK_TTL_S).

    with creation_lock(ledger, "distill-v1"):
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

from redis.exceptions import LockError

from workers import keys
from workers.errors import JobBusyError
from workers.ledger import Ledger
from workers.retry import REDIS_ERRORS

log = logging.getLogger(__name__)

# The creation lock outlives a killed enqueue by at most this long; a live one renews it
# every third of it, so a slow sink cannot make it lapse.
LOCK_TTL_S = 30.0


@contextmanager
def creation_lock(ledger: Ledger, job: str) -> Iterator[None]:
    """Hold the job's enqueue lock for the block; JobBusyError if another enqueue holds it."""
    name = keys.job_part(job, "enqueue")
    token = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
    lock = ledger.r.lock(name, timeout=LOCK_TTL_S, blocking=False, thread_local=False)
    if not lock.acquire(token=token):
        who = creation_holder(ledger, job, clear_stale=True)
        if who is not None or not lock.acquire(token=token):
            raise JobBusyError(
                f"job {job} is being created by another enqueue (host:pid {who or '?'}); wait "
                f"for it, or if it was killed on another host, run this again in "
                f"{LOCK_TTL_S:.0f}s")
    stop = threading.Event()

    def renew() -> None:
        while not stop.wait(LOCK_TTL_S / 3):
            try:
                lock.reacquire()
            except LockError:
                log.error("job %s: the enqueue lock was lost", job)
                return
            except REDIS_ERRORS as exc:  # a Redis blip: the next round tries again
                log.info("job %s: enqueue lock not renewed (%s)", job, exc)

    renewer = threading.Thread(target=renew, name="fleetgen-enqueue-lock", daemon=True)
    renewer.start()
    try:
        yield
    finally:
        stop.set()
        renewer.join()
        # Expired meanwhile: nobody else can have created the job without it.
        with contextlib.suppress(LockError):
            lock.release()


def creation_holder(ledger: Ledger, job: str, *, clear_stale: bool = False) -> str | None:
    """`host:pid` of the enqueue holding the job's lock, or None. A holder on this host whose
    process is gone (kill -9) counts as none; `clear_stale` also removes its lock then."""
    name = keys.job_part(job, "enqueue")
    raw = ledger.r.get(name)
    if not isinstance(raw, bytes):
        return None
    holder = raw.decode()
    host, _, rest = holder.partition(":")
    pid = rest.partition(":")[0]
    if host != socket.gethostname() or not pid.isdigit() or _alive(int(pid)):
        return f"{host}:{pid}"
    if clear_stale:
        # redis-py's compare-and-delete: only if the dead holder still has it (if it changed
        # hands meanwhile, the caller's next acquire decides).
        with contextlib.suppress(LockError):
            ledger.r.lock(name, timeout=LOCK_TTL_S).do_release(raw)
    return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True

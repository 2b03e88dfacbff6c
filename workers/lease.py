"""A batch's lease and the attempt taken with it: acquired once, ended once.

`Lease.acquire` takes the batch's lease in the ledger, which counts an attempt, and starts its
heartbeat (workers/heartbeat.py) on the worker's loop. `end` ends it exactly once, as `ending`
decides from how the run ended: the attempt spent (its cause kept as the reason the batch's
prompts get at the limit), or refunded (the batch finished or was handed back); a lease the
heartbeat found lost gives its attempt back by hand, since the release refunds only a lease it
still holds.

    lease = Lease.acquire(ledger, loop, live, settings, worker, job, batch, on_paused)
    try:
        outcome = run(lease)
    except BaseException as exc:
        lease.end(exc)
        raise
    lease.end(outcome.status)
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from tenacity import RetryError, Retrying, retry_if_result, stop_after_delay, wait_fixed

from fleetgen.errors import (
    JobError,
    LeaseLostError,
    ServerDownError,
    SinkError,
    WorkerStoppingError,
)
from fleetgen.ledger import Ledger
from fleetgen.liveledger import LiveLedger
from fleetgen.retry import on_redis
from fleetgen.settings import Settings
from workers.bridge import LoopThread
from workers.heartbeat import follow, keep_lease, stop_heartbeat


@dataclass(frozen=True)
class Ending:
    """How a leased run of a batch ended, as its release and its metrics need it (`ending`)."""

    status: str
    # The attempt taken with the lease counts toward FLEETGEN_BATCH_MAX_ATTEMPTS.
    spent: bool = False
    # The heartbeat found the lease taken over or could not renew it: the attempt is given back
    # by hand if the release finds the lease gone (a release refunds only a lease it holds).
    lease_lost: bool = False
    # The error ends here, as an outcome of this status; otherwise it goes on to the task,
    # which requeues a hand-back and lets Celery record anything else.
    handled: bool = False


def ending(ended: BaseException | str) -> Ending:
    """How a leased run that raised `ended`, or returned with the status `ended`, ends; the one
    place that decides whether its attempt is spent or refunded.

    An attempt is spent only if the worker dies holding the batch (no release runs then) or
    the run meets an error nobody planned for; a finished batch and every planned hand-back
    give it back.
    """
    if isinstance(ended, str):
        return Ending(ended)
    if isinstance(ended, LeaseLostError):
        # Another copy owns the batch now, or will. This worker is alive and noticed, so the
        # batch did not kill it (a Redis outage longer than the lease does this).
        return Ending("stopped", lease_lost=True, handled=True)
    if isinstance(ended, JobError):
        # Paused, cancelled, or its input is missing (the job was paused for that): `resume`
        # re-dispatches it.
        return Ending("handed-back", handled=True)
    if isinstance(ended, (ServerDownError, WorkerStoppingError, SinkError)):
        # The server or the sink stayed down, or this worker is stopping: not the batch's
        # fault, and the task requeues it.
        return Ending("handed-back")
    if isinstance(ended, Exception):
        return Ending("error", spent=True)
    # Interrupted (SystemExit, KeyboardInterrupt, a cancelled coroutine): the worker is going
    # away, and its release hands the batch back.
    return Ending("error")


class Lease:
    """One leased run of a batch: its token, the attempt it counts, its heartbeat."""

    def __init__(self, ledger: Ledger, loop: LoopThread, settings: Settings, worker: str,
                 job: str, batch: str, token: str, attempt: int,
                 heartbeat: asyncio.Task[None]) -> None:
        self._ledger = ledger
        self._loop = loop
        self._settings = settings
        self._worker = worker
        self.job, self.batch, self.token = job, batch, token
        # The attempt this run is, counting earlier ones spent.
        self.attempt = attempt
        self._heartbeat = heartbeat
        # How the run ended, once `end` ran.
        self.ending: Ending | None = None

    @classmethod
    def acquire(cls, ledger: Ledger, loop: LoopThread, live: LiveLedger, settings: Settings,
                worker: str, job: str, batch: str,
                on_paused: Callable[[str, bool], None]) -> Lease | None:
        """Take the batch's lease and start renewing it; None while another run holds it."""
        token = f"{worker}/{uuid.uuid4().hex[:12]}"
        attempt = ledger.leases.acquire(job, batch, token, settings.lease_ttl_s)
        if attempt is None:
            return None

        async def start() -> asyncio.Task[None]:
            return asyncio.create_task(keep_lease(live, settings, job, batch, token, on_paused))

        # Renewed from here to the end: reading the input, generating and writing may each
        # wait out a sink outage, and a lease that lapsed meanwhile would send the batch to
        # another worker and spend an attempt.
        return cls(ledger, loop, settings, worker, job, batch, token, attempt,
                   loop.run(start()))

    async def held(self) -> None:
        """End as the heartbeat ends: raising LeaseLostError when the lease is lost, JobError
        when the job is cancelled. Cancelling this leaves the heartbeat running."""
        await follow(self._heartbeat)

    def settled_attempts(self) -> int:
        """The batch's spent attempts once late refunds have landed (this one included).

        A live worker that lost its lease in a Redis outage gives its attempt back only when
        Redis is back, which can be after the reconciler re-dispatched the batch and this copy
        counted it. Before the batch's prompts are failed on the limit, this waits one lease
        period for them.
        """
        limit = self._settings.batch_max_attempts
        if self.attempt <= limit:
            return self.attempt
        waiting = Retrying(retry=retry_if_result(lambda spent: spent > limit),
                           stop=stop_after_delay(self._settings.lease_ttl_s),
                           wait=wait_fixed(min(1.0, self._settings.lease_renew_s)))
        try:
            return waiting(self._attempts)
        except RetryError as still:
            spent: int = still.last_attempt.result()
            return spent

    def _attempts(self) -> int:
        return on_redis(f"batch {self.job}/{self.batch}: attempts",
                        lambda: self._ledger.leases.attempts(self.job, self.batch))

    def end(self, ended: BaseException | str) -> Ending:
        """End the lease, once, as `ending` says for what the run raised or returned with: stop
        the heartbeat, keep why an attempt was spent, give the lease back (refunding the
        attempt unless it was spent). A second call returns the first ending."""
        if self.ending is not None:
            return self.ending
        end = self.ending = ending(ended)
        job, batch = self.job, self.batch
        if end.spent and isinstance(ended, BaseException):
            cause = f"{self._worker}: {type(ended).__name__}: {ended}"
            on_redis(f"batch {job}/{batch}: note cause",
                     lambda: self._ledger.leases.note_cause(job, batch, cause))
        self._loop.run(stop_heartbeat(self._heartbeat))
        released = on_redis(f"batch {job}/{batch}: release", lambda: self._ledger.leases.release(
            job, batch, self.token, refund=not end.spent))
        if end.lease_lost and not released:
            on_redis(f"batch {job}/{batch}: refund", lambda: self._ledger.leases.refund(job, batch))
        return end

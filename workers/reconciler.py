"""Re-dispatches batches that Celery on Redis would lose or hold for an hour.

Runs in every worker as a thread; a Redis lock lets one of them work per round. Rules, per job
that is running:
- `running` with no live lease: its worker died (SIGKILL, partition) -> dispatch it again now,
  not after the broker's visibility timeout. Its finished prompts are in the checkpoint.
- `running` with a live lease whose worker has no Redis connection left, two rounds in a row:
  the worker's process is gone (the kernel closed its sockets; a live worker reconnects within
  a heartbeat after a Redis restart) -> break the lease and dispatch it again, without waiting
  for the lease to expire. Only for workers that name their connections (registry flag); a
  lost node keeps its sockets half-open and is left to the lease TTL.
- `queued` for longer than the grace period and in no broker list nor the unacked hash: the
  message was lost (a BRPOP in flight during a crash, a Redis restart) -> dispatch it again.
Duplicates this may create are harmless: leases stop concurrent copies and the sink's
create-if-absent write makes a late copy a no-op.

A round walks the active jobs only (`fg:jobs`), plus the jobs finished in the last
FINISHED_GRACE_S: a fleet's thousands of finished jobs cost it nothing. Each round, in every
worker, the series of jobs finished before that leave the worker's /metrics.
"""

from __future__ import annotations

import logging
import threading
import time

from celery import Celery

from fleetgen import keys
from fleetgen.dispatch import dispatch
from fleetgen.ledger import ACTIVE, STATE_RUNNING, Ledger
from fleetgen.progress import ProgressWarnings, write_progress
from fleetgen.retry import REDIS_ERRORS
from fleetgen.settings import Settings
from workers import metrics

log = logging.getLogger(__name__)
# A finished job is still visited this long: its last progress.json (state done) may wait a
# minute for the once-a-minute gate, and its metric series stay for the scrapes that read their
# last values (Prometheus scrapes every minute by default).
FINISHED_GRACE_S = 180.0


class Reconciler:
    def __init__(self, app: Celery, settings: Settings, owner: str) -> None:
        self.app = app
        self.settings = settings
        self.owner = owner
        self.ledger = Ledger.connect(settings)
        self._stop = threading.Event()
        # Batches seen in no state last round; re-dispatched if still there this round.
        self._suspects: set[tuple[str, str]] = set()
        self._client_list_refused = False
        self.progress_warnings = ProgressWarnings()
        self._thread = threading.Thread(target=self._loop, name="fleetgen-reconciler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _loop(self) -> None:
        # Since when Redis has been out of reach: one line when it goes, one when it is back.
        down_since: float | None = None
        while not self._stop.wait(self.settings.reconcile_interval_s):
            try:
                if self._take_turn():
                    self.reconcile_once()
                self.forget_finished_series()
            except REDIS_ERRORS as exc:
                if down_since is None:
                    down_since = time.monotonic()
                    log.warning("reconciler %s: Redis unreachable (%s); trying every %.0fs, "
                                "quiet until it is back", self.owner, exc,
                                self.settings.reconcile_interval_s)
                continue
            except Exception:
                log.exception("reconciler %s: round failed; next round in %.0fs",
                              self.owner, self.settings.reconcile_interval_s)
            if down_since is not None:
                log.warning("reconciler %s: Redis is back after %.0fs", self.owner,
                            time.monotonic() - down_since)
                down_since = None

    def _take_turn(self) -> bool:
        ttl = int(self.settings.reconcile_interval_s * 1000 * 0.9)
        return self.ledger.registry.take_reconciler_turn(self.owner, ttl)

    def reconcile_once(self) -> dict[str, int]:
        """One pass over all running jobs; returns how many batches were re-dispatched, by cause."""
        counts = {"dead_owner": 0, "gone_owner": 0, "lost_message": 0, "no_state": 0}
        waiting: set[tuple[str, str]] | None = None
        now = time.time()
        # Leases whose owner had no Redis connection in the last round (kept in Redis: the
        # next round may be another worker's reconciler).
        previous = self.ledger.registry.ownerless_leases()
        ownerless: set[str] = set()
        liveness: dict[str, bool] | None = None  # read once per round, when first needed
        for job in self.ledger.jobs.finished(since=now - FINISHED_GRACE_S):
            if self.ledger.jobs.exists(job):
                write_progress(self.ledger, job, now, settings=self.settings,
                               warnings=self.progress_warnings)
            # Again: writing progress.json (or a straggler's last checkpoint) after the job
            # finished made keys that do not expire yet.
            self.ledger.jobs.settle(job, now)
        for job in self.ledger.jobs.active():
            write_progress(self.ledger, job, now, settings=self.settings,
                               warnings=self.progress_warnings)
            # A job whose finish nobody filed (a crash between its last batch and the filing)
            # leaves the active jobs here.
            if self.ledger.jobs.settle(job, now) != ACTIVE:
                continue
            state, _ = self.ledger.jobs.state(job)
            if state != STATE_RUNNING:
                continue
            manifest = self.ledger.jobs.load(job)
            running = self.ledger.batches.running(job)
            # Every running batch's lease holder in one read, not a call per batch.
            holders = self.ledger.leases.tokens(job, list(running))
            orphans = [
                b for b, started in running.items()
                if now - started > self.settings.lease_renew_s and holders[b] is None
            ]
            for batch in orphans:
                self.ledger.batches.drop_running(job, batch)
            if orphans:
                log.warning("reconciler: %s: %d batches lost their worker, re-dispatching %s",
                            job, len(orphans), orphans[:5])
                for batch in orphans:
                    self.ledger.leases.note_cause(job, batch, "its worker died or lost its lease "
                                           "(the lease expired)")
                dispatch(self.app, self.ledger, job, orphans, manifest.queue, redrive=True)
                counts["dead_owner"] += len(orphans)
            leased = [b for b in running if b not in orphans]
            if leased:
                liveness = self._owner_liveness() if liveness is None else liveness
                gone = self._gone_owner_batches(job, {b: holders[b] for b in leased}, liveness,
                                                previous, ownerless)
                if gone:
                    log.warning("reconciler: %s: the workers holding %d batches closed every "
                                "Redis connection, re-dispatching %s", job, len(gone), gone[:5])
                    for batch in gone:
                        self.ledger.leases.note_cause(job, batch, "its worker's process is gone (no "
                                               "Redis connection left)")
                    dispatch(self.app, self.ledger, job, gone, manifest.queue, redrive=True)
                    counts["gone_owner"] += len(gone)
            stale = [
                b for b, ts in self.ledger.batches.queued(job).items()
                if now - ts > self.settings.lost_message_grace_s
            ]
            if stale:
                waiting = self.broker_batches() if waiting is None else waiting
                lost = [b for b in stale if (job, b) not in waiting and not self.ledger.batches.is_done(job, b)]
                if lost:
                    log.warning("reconciler: %s: %d queued batches are in no broker queue, "
                                "re-dispatching %s", job, len(lost), lost[:5])
                    dispatch(self.app, self.ledger, job, lost, manifest.queue, redrive=True)
                    counts["lost_message"] += len(lost)
                fresh = [b for b in stale if (job, b) in waiting]
                if fresh:
                    self.ledger.batches.mark_queued_and_settle(job, fresh)
            counts["no_state"] += self._stateless(job, manifest.queue)
        self.ledger.registry.set_ownerless_leases(ownerless, int(3000 * self.settings.reconcile_interval_s))
        return counts

    def forget_finished_series(self, now: float | None = None) -> list[str]:
        """Drop this worker's metric series of jobs finished more than FINISHED_GRACE_S ago (or
        gone from Redis); returns those jobs. Each worker does it for its own /metrics."""
        seen = metrics.job_series()
        if not seen:
            return []
        now = time.time() if now is None else now
        kept = (set(self.ledger.jobs.active())
                | set(self.ledger.jobs.finished(since=now - FINISHED_GRACE_S)))
        gone = sorted(seen - kept)
        for job in gone:
            metrics.forget_job(job)
        if gone:
            log.info("metrics: %s: dropped the series of %d finished jobs: %s", self.owner,
                     len(gone), ", ".join(gone[:5]))
        return gone

    def _owner_liveness(self) -> dict[str, bool]:
        """Each worker that names its Redis connections -> whether one is open right now.
        Empty when this Redis refuses CLIENT LIST (some managed services)."""
        if self._client_list_refused:
            return {}
        open_names = self.ledger.registry.client_names()
        if open_names is None:
            log.info("reconciler: CLIENT LIST refused; dead workers wait for their leases")
            self._client_list_refused = True
            return {}
        return {worker: keys.worker_client(worker) in open_names
                for worker in self.ledger.registry.workers()}

    def _gone_owner_batches(self, job: str, holders: dict[str, str | None],
                            liveness: dict[str, bool], previous: set[str],
                            ownerless: set[str]) -> list[str]:
        """Of `holders` (batch -> its lease's token, None when none is alive), the batches whose
        lease owner has had no connection for two rounds; their leases broken. Owners missing
        from `liveness` (not registered, or no CLIENT LIST) count as alive."""
        gone = []
        for batch, token in holders.items():
            if token is None or liveness.get(keys.lease_owner(token), True):
                continue
            seen = f"{job}|{batch}|{token}"
            ownerless.add(seen)
            if seen in previous and self.ledger.leases.release(job, batch, token, refund=False):
                gone.append(batch)
        return gone

    def _stateless(self, job: str, queue: str) -> int:
        """Batches in no ledger state at all (a Redis restart lost their last write)."""
        known = (self.ledger.batches.done(job) | set(self.ledger.batches.queued(job))
                 | set(self.ledger.batches.running(job)))
        missing = {(job, b) for b in self.ledger.jobs.batches(job) if b not in known}
        confirmed = [b for j, b in missing & self._suspects]
        self._suspects = {s for s in self._suspects if s[0] != job} | missing
        if not confirmed:
            return 0
        waiting = self.broker_batches()
        lost = [b for b in confirmed if (job, b) not in waiting and not self.ledger.leases.alive(job, b)]
        if lost:
            log.warning("reconciler: %s: %d batches have no state, re-dispatching %s",
                        job, len(lost), lost[:5])
            dispatch(self.app, self.ledger, job, lost, queue, redrive=True)
        return len(lost)

    def broker_batches(self) -> set[tuple[str, str]]:
        return self.ledger.batches.in_broker(grace_s=self.settings.lost_message_grace_s)


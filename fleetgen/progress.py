"""`{output}/{job}/progress.json`: the status figures, written next to the output once a minute.

Whoever looks at the bucket (or a folder on a shared disk) sees how the job is doing without
Redis access. The workers' reconciler calls `write_progress` for every job each round; a Redis
key set with NX and a 60 s expiry lets one call per job per minute through, whichever worker
makes it. A job that stopped changing (done, paused, cancelled) is written once more, then
left alone. Everything in it comes from the ledger: its per-GPU table shows each server as its
worker last published it (fleetgen/fleet.py `published_fleet`).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field

import orjson

from fleetgen.errors import SinkError
from fleetgen.fleet import published_fleet
from fleetgen.jobview import JobStatus, ended_at, job_status
from fleetgen.ledger import STATE_RUNNING, Ledger
from fleetgen.settings import Settings
from fleetgen.sink import open_sink

log = logging.getLogger(__name__)
PROGRESS_EVERY_S = 60
PROGRESS_FILE = "progress.json"
# A job whose output stays out of reach (a bucket gone, credentials missing) is said once, then
# again this often while it lasts: its batches wait on the same sink and say so themselves.
REPEAT_WARNING_S = 1800.0


@dataclass
class ProgressWarnings:
    """Which jobs' progress.json could not be written, and when that was last said.

    One per reconciler: the first failure of a job is a warning, the same failure is repeated
    every `REPEAT_WARNING_S` while it lasts, and the first write after it says it is over.
    """

    repeat_s: float = REPEAT_WARNING_S
    _since: dict[str, tuple[float, float]] = field(default_factory=dict)  # job -> (first, last said)

    def failed(self, job: str, now: float, reason: str) -> None:
        first, said = self._since.get(job, (now, -1.0))
        if said >= 0 and now - said < self.repeat_s:
            self._since[job] = (first, said)
            return
        self._since[job] = (first, now)
        if said < 0:
            log.warning("job %s: progress.json not written (%s); said again every %.0f min "
                        "while it lasts", job, reason, self.repeat_s / 60)
        else:
            log.warning("job %s: progress.json still not written after %.0f min (%s)",
                        job, (now - first) / 60, reason)

    def written(self, job: str, now: float) -> None:
        since = self._since.pop(job, None)
        if since is not None:
            log.warning("job %s: progress.json written again after %.0f min", job,
                        (now - since[0]) / 60)


def progress_key(job: str) -> str:
    """Sink key of the job's progress file."""
    return f"{job}/{PROGRESS_FILE}"


def write_progress(ledger: Ledger, job: str, now: float, *, settings: Settings | None = None,
                   warnings: ProgressWarnings | None = None) -> bool:
    """Write the job's progress.json if a minute has passed since the last one; True if written.

    Never raises: progress is advisory, and the reconciler round that calls it has real work
    to do for every job after this one. With `warnings`, a sink that stays out of reach is
    said once and then rarely, not every minute.
    """
    try:
        if not ledger.counters.claim_progress_turn(job, now, PROGRESS_EVERY_S):
            return False
        written = _write(ledger, job, now, settings)
    except SinkError as exc:
        # The sink is down (the batches ride it out on their own): one line, not a traceback.
        if warnings is None:
            log.warning("job %s: progress.json not written this minute (%s)", job, exc)
        else:
            warnings.failed(job, now, str(exc))
        return False
    except Exception:
        log.exception("job %s: progress.json not written this minute", job)
        return False
    if warnings is not None:
        warnings.written(job, now)
    return written


def record_state(ledger: Ledger, job: str, now: float) -> bool:
    """Write the job's progress.json now, whatever the minute's turn: an operator's pause,
    cancel or resume is in the output before the command returns, and a rebuild after Redis
    lost the job keeps it (producer/rebuild.py). Never raises; True if written."""
    try:
        return _write(ledger, job, now, None)
    except SinkError as exc:
        log.warning("job %s: progress.json not written (%s): a rebuild would not know its "
                    "state", job, exc)
        return False


def _write(ledger: Ledger, job: str, now: float, settings: Settings | None) -> bool:
    status = job_status(ledger, job, now)
    mark = _fingerprint(status)
    if status.state != STATE_RUNNING and ledger.counters.progress_mark(job) == mark:
        return False
    # The servers as their workers published them: a reconciler round sends no request to
    # every server of the fleet (only `producer status` reads them live).
    status = dataclasses.replace(status, fleet=published_fleet(
        ledger, status.workers, status.elapsed_s, now=now, ended_at=ended_at(status)))
    style = settings.s3_addressing_style if settings else "path"
    sink = open_sink(status.output, addressing_style=style)
    sink.put(progress_key(job), status.to_json(option=orjson.OPT_INDENT_2))
    ledger.counters.set_progress_mark(job, mark)
    log.debug("job %s: progress.json written (%d/%d)", job, status.done, status.total)
    return True


def _fingerprint(status: JobStatus) -> bytes:
    """What must change for a stopped job's progress.json to be written again."""
    accepted = status.quality.accepted if status.quality else None
    return (f"{status.state}|{status.done}|{status.failed}|{status.checkpointed}|"
            f"{accepted}").encode()

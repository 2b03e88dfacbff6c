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

import orjson

from fleetgen.errors import SinkError
from fleetgen.fleet import published_fleet
from fleetgen.jobview import JobStatus, job_status
from fleetgen.ledger import STATE_RUNNING, Ledger
from fleetgen.settings import Settings
from fleetgen.sink import open_sink

log = logging.getLogger(__name__)
PROGRESS_EVERY_S = 60
PROGRESS_FILE = "progress.json"


def progress_key(job: str) -> str:
    """Sink key of the job's progress file."""
    return f"{job}/{PROGRESS_FILE}"


def write_progress(ledger: Ledger, job: str, now: float, *, settings: Settings | None = None) -> bool:
    """Write the job's progress.json if a minute has passed since the last one; True if written.

    Never raises: progress is advisory, and the reconciler round that calls it has real work
    to do for every job after this one.
    """
    try:
        if not ledger.counters.claim_progress_turn(job, now, PROGRESS_EVERY_S):
            return False
        return _write(ledger, job, now, settings)
    except SinkError as exc:
        # The sink is down (the batches ride it out on their own): one line, not a traceback.
        log.warning("job %s: progress.json not written this minute (%s)", job, exc)
        return False
    except Exception:
        log.exception("job %s: progress.json not written this minute", job)
        return False


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
        ledger, status.workers, status.elapsed_s, now=now))
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

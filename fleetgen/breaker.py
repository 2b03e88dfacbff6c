"""The failure breaker: a job whose prompts keep failing for one reason pauses itself.

A refusal every server gives (a model none serves, a wrong API key, a parameter all refuse:
HTTP 4xx, never retried) would run a job through all its prompts as failures and end it
`done`: a dataset of nothing. The quality canary judges answers, not failures, and can be
turned off; the breaker watches every job. It judges only such refusals (causes.job_caused):
a prompt's own failure (too long, refused for its content) fails that prompt alone however many
come in a row, and a server that fails what it is sent is taken out of rotation by its worker
(workers/flow.py) instead of failing prompts.

Each finished prompt's outcome goes to a capped list under the job in the same script call as
its checkpoint (record_group.lua): "" for an answer, the failure's `cause` for a failure; the
answers that skip the checkpoint (an embeddings batch's) go there as a count, in the next
group's call (CheckpointWriter.answered).
After a group that recorded failures, the same call returns the list, and the worker judges
it on its loop (`Breaker.judge`): it trips when the newest `streak` outcomes are failures with
one cause, or when one cause makes at least `share` of the last `window` outcomes. A trip
pauses the job as the canary does: reason `failures: ...`, one example failure on the job,
the job held in this worker at once.

`python -m producer resume JOB` sends the cause's failed prompts again (producer/control.py);
`--accept-failures` keeps them as failures, and the breaker no longer trips on that cause for
the job.

    trip = verdict(outcomes, Limits(streak=20, window=50, share=0.9))
"""

from __future__ import annotations

import collections
import logging
import math
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

import orjson

from fleetgen.causes import KEY_CHARS, job_caused, normalise
from fleetgen.checkpoints import Entry, Outcomes
from fleetgen.ledger import STATE_RUNNING, FailureExample
from fleetgen.liveledger import LiveLedger
from fleetgen.records import OutputRecord, is_failure, read_record
from fleetgen.settings import Settings

log = logging.getLogger(__name__)

# Every reason the breaker gives starts so; `resume` tells a breaker pause by it.
REASON_PREFIX = "failures:"
# Enough of an example's message to recognise the failure on a status screen.
_EXAMPLE_CHARS = 500


def cause(code: str, message: str) -> str:
    """What failures share when one thing breaks them all: the error code and the message
    with what differs from request to request (ids, quoted values, numbers) read as
    placeholders (causes.normalise), cut to KEY_CHARS characters."""
    return f"{code}: {normalise(message)}"[:KEY_CHARS]


def outcome(record: OutputRecord) -> str | None:
    """What the breaker keeps of one finished prompt: "" for an answer, the cause of a
    failure the job may share (causes.job_caused); None for a failure that is one prompt's
    own (too long, refused for its content, a server error while the server answered others)
    and for one never sent (its batch spent its attempts: no server spoke, and `requeue
    --failed` is that failure's remedy)."""
    if not is_failure(record):
        return ""
    code = record["error"]["code"]
    # A rollout's failure came from its own code, whether or not it had called the server.
    if (record["tries"] == 0 and "calls" not in record) or not job_caused(code):
        return None
    return cause(code, record["error"]["message"])


@dataclass(frozen=True)
class Limits:
    """When the breaker trips: FLEETGEN_BREAKER_STREAK, _WINDOW and _SHARE (streak 0: never)."""

    streak: int
    window: int
    share: float

    @classmethod
    def of(cls, settings: Settings) -> Limits:
        return cls(settings.breaker_streak, settings.breaker_window, settings.breaker_share)

    @property
    def kept(self) -> int:
        """Outcomes a job's window keeps (0: the breaker is off, keep none)."""
        return max(self.streak, self.window) if self.streak else 0


@dataclass(frozen=True)
class Trip:
    cause: str
    failed: int
    of: int

    def reason(self, job: str) -> str:
        return (f"{REASON_PREFIX} {self.failed} of the last {self.of} prompts failed with "
                f"{self.cause!r}; fix the cause, then `python -m producer resume {job}` sends "
                f"them again (--accept-failures keeps them as failures)")


def verdict(outcomes: Sequence[str], limits: Limits,
            accepted: Collection[str] = ()) -> Trip | None:
    """The trip a window of outcomes (newest first) calls for, or None. Causes in `accepted`
    never trip it."""
    if not limits.streak:
        return None
    newest = outcomes[:limits.streak]
    first = newest[0] if newest else ""
    if (len(newest) == limits.streak and first and first not in accepted
            and all(o == first for o in newest)):
        return Trip(first, limits.streak, limits.streak)
    if len(outcomes) < limits.window:
        return None
    counts = collections.Counter(o for o in outcomes[:limits.window] if o and o not in accepted)
    if not counts:
        return None
    top, n = counts.most_common(1)[0]
    # Against float noise: 0.9 of 50 is 45, not 45.000000000000004.
    if n >= math.ceil(limits.share * limits.window - 1e-9):
        return Trip(top, n, limits.window)
    return None


def accepted_causes(raw: bytes | str | None) -> list[str]:
    """The causes `resume --accept-failures` accepted for a job (its `breaker_accepted`)."""
    return list(orjson.loads(raw)) if raw else []


class Breaker:
    """The breaker's side in one worker process, on its loop: the checkpoint writer calls
    `judge` after each group that recorded a failure; a trip holds the job here at once
    (QualityWatch.trip), then pauses it for every worker."""

    def __init__(self, live: LiveLedger, limits: Limits, trip: Callable[[str], None]) -> None:
        self._live = live
        self.limits = limits
        self._trip = trip  # QualityWatch.trip: holds the job in this worker

    @property
    def kept(self) -> int:
        return self.limits.kept

    async def judge(self, job: str, failures: list[Entry], seen: Outcomes) -> None:
        """Judge the job's window after a group whose first copies include `failures`."""
        if seen.state != STATE_RUNNING.encode():
            return
        trip = verdict([o.decode() for o in seen.window], self.limits,
                       accepted_causes(seen.accepted))
        if trip is None:
            return
        example = next((e for e in failures if e.outcome == trip.cause), None)
        if example is None:
            # Not this group's cause (the share rule can name an older one): the next group
            # that has one of its failures pauses the job.
            return
        record = read_record(example.record)
        if not is_failure(record):
            return
        reason = trip.reason(job)
        log.warning("job %s: paused by the failure breaker: %s", job, reason)
        self._trip(job)
        await self._live.pause_by_breaker(job, reason, trip.cause, FailureExample(
            record["custom_id"], record["error"]["code"],
            record["error"]["message"][:_EXAMPLE_CHARS]))

"""The quality canary's side in one worker process: which jobs it watches, which it holds,
and when a group of new answers calls for judging the job's recent window (canary.py).

Lives on the worker's loop: the checkpoint writer calls `judge` after each group it commits,
batches read `held` before sending each request.
"""

from __future__ import annotations

import dataclasses
import logging
import time

from fleetgen import canary
from fleetgen.ledger import STATE_RUNNING, EndVerdict
from fleetgen.liveledger import LiveLedger

log = logging.getLogger(__name__)
# After the first stretch, the window is judged once per this many answers (per job).
CANARY_EVERY = 10
# A job with fewer prompts than the canary's min_completions is judged once, at its last
# answer, on all its answers, if it has at least this many (fewer say nothing either way).
END_MIN_ANSWERS = 10
# A job this worker has just paused stays held here this long whatever a state read says: a
# read sent before the pause reached Redis (a batch starting, a heartbeat) may still answer
# `running` a few milliseconds later, and a server refusing prompts at once would fail them
# all until the next heartbeat. Short enough that no `resume` comes within it.
TRIPPED_HOLD_S = 0.5


class QualityWatch:
    def __init__(self, live: LiveLedger) -> None:
        self._live = live
        # Canary thresholds of the jobs this worker has run, and their sizes in prompts.
        self._thresholds: dict[str, canary.Thresholds] = {}
        self._prompts: dict[str, int] = {}
        # Jobs seen paused: their batches send no new request.
        self.held: set[str] = set()
        # Jobs this worker paused itself: held at least until then (monotonic clock).
        self._tripped: dict[str, float] = {}

    def watch(self, job: str, thresholds: canary.Thresholds, prompts: int) -> None:
        """A batch of `job` (of `prompts` prompts) starts here, the job is running: use its
        thresholds."""
        self._thresholds[job] = thresholds
        self._prompts[job] = prompts

    def hold(self, job: str, paused: bool) -> None:
        if paused:
            self.held.add(job)
        elif time.monotonic() >= self._tripped.get(job, 0.0):
            self.held.discard(job)

    def trip(self, job: str) -> None:
        """This worker pauses the job itself (the canary, the failure breaker): hold it here
        at once, and for TRIPPED_HOLD_S against state reads that left before the pause."""
        self._tripped[job] = time.monotonic() + TRIPPED_HOLD_S
        self.hold(job, True)

    def window(self, job: str) -> int:
        """Answers the job's canary keeps (0: the canary is off, feed it nothing)."""
        thresholds = self._thresholds.get(job)
        return thresholds.window if thresholds is not None and thresholds.enabled else 0

    async def judge(self, job: str, seen_before: int, seen: int) -> None:
        """Judge the window if this group of answers reached a judging point: every answer
        for the first stretch after K (the pause lands at K when the window is bad), then
        every CANARY_EVERY answers; a job smaller than K once, at its last answer."""
        thresholds = self._thresholds[job]
        k = thresholds.min_completions
        total = self._prompts.get(job, 0)
        at_end = total < k and seen_before < total <= seen
        due = at_end or (seen >= k and (seen_before < k + CANARY_EVERY
                                        or seen // CANARY_EVERY > seen_before // CANARY_EVERY))
        if not due:
            return
        state, accepted = await self._live.canary_state(job)
        if accepted or state != STATE_RUNNING:
            return
        samples = await self._live.recent_answers(job)
        verdict = canary.evaluate(samples, thresholds,
                                  min_answers=END_MIN_ANSWERS if at_end else None)
        if at_end and verdict is not None:
            verdict = dataclasses.replace(verdict, reason=(
                f"{verdict.reason}, judged at the job's end (it has fewer than {k} prompts)"))
        if at_end:
            # Status tells a small job was judged (or why not), not only when it failed.
            answers = sum(1 for x in samples if not x.failed)
            await self._live.note_canary_end(job, EndVerdict(
                answers, answers >= END_MIN_ANSWERS, verdict.reason if verdict else None))
        if verdict is None:
            return
        log.warning("job %s: paused by the quality canary: %s", job, verdict.reason)
        self.trip(job)
        await self._live.pause_by_canary(job, verdict.reason, verdict.examples, seen)

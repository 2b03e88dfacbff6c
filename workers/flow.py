"""The worker's server as a load balancer sees a backend: what its requests met, whether it is
fit to take work, how hard to push it while it says it is full.

Every request's end is one of a few causes, each with one response (docs/guides/failure-modes.md):

- answered: counted; an overload ceiling grows back each quiet second.
- overloaded (HTTP 429, 503, a queue-full refusal): the request was not run. It costs no
  attempt and never reaches the failure breaker; it is sent again after the server's
  `Retry-After` (else the one backoff policy), keeping its slot meanwhile (so a refusal frees
  no slot for the next request to be refused in turn), and the ceiling on requests in flight
  is cut to a tenth under what was in flight (at most once a second: a burst of refusals is
  one signal). `Ceiling`.
- server (5xx, a reset, an abort, a timeout): tried again under the prompt's attempts, within a
  retry budget. Failures are evidence about the server only when they come from many prompts:
  `EJECT_AFTER` in a row from as many different prompts, which are also half of what the server
  did lately (running requests included), make the server suspect, and a one-token probe then
  decides (Envoy's outlier detection, confirmed): unanswered, the server goes out of rotation —
  the worker stops sending, hands its batches back with no attempt spent, takes no new one,
  and probes it on a growing backoff until a probe is answered; answered, the failures were
  the prompts' own (a poison prompt fails alone after its attempts; it never ejects a server
  that answers the rest). `Rotation`.
- hung: requests in flight and nothing back, of any kind, for many times the usual gap between
  replies (at least FLEETGEN_HANG_AFTER_S), and a time-boxed probe unanswered too: the server
  is out of rotation as hung and its requests are abandoned, handed back at no attempt.
  `Progress`.
- prompt / job (a 4xx): the prompt fails alone; only a refusal that is not the prompt's own
  (causes.job_caused) is judged by the failure breaker, which pauses the job.

Resends of failed requests are capped as a share, not paced (gRPC's retry throttling, with
Envoy's retry budget in mind): each first try earns `RETRY_RATIO` of a resend token and each
answer `ANSWER_TOKENS`, a resend takes one, and a trickle of `RETRY_FLOOR_PER_S` keeps a lone
request going. A server that fails everything sees at most a fifth more requests than first
tries, plus one a second; one that answers again earns its backlog back as fast as it answers;
one a probe showed working (the failures were the prompts') refills the budget. Overload waits
never draw on it: a full server's refusals are paced by its Retry-After and the ceiling.
`RetryBudget`.

`Outcomes` keeps the last `WINDOW_S` of it per second for `producer status`, the registry entry,
`/metrics` and Flower's task results (fleetgen/fleet.py `ServerHealth`).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from fleetgen.errors import GenerationError, OverloadedError
from fleetgen.fleet import ServerHealth
from fleetgen.retry import backoff_delay

log = logging.getLogger(__name__)

# How far back the request counts shown in `status` reach.
WINDOW_S = 300.0
# A server goes out of rotation after this many server-caused failures in a row that are also
# FAILING_SHARE of what it did over the last FAILING_WINDOW_S: its answers, its failures and
# the requests it is running now. A run alone would not do: failures come back in milliseconds
# and answers after seconds, so the first requests to end at a server answering two thirds of
# them may well be five failures, while the rest, still running, say the server works.
EJECT_AFTER = 5
FAILING_SHARE, FAILING_WINDOW_S = 0.5, 10.0
# Probes of a server out of rotation: the first within this, then doubling with jitter, at
# most one a second; the cap is how long a healed server may wait to be used again.
PROBE_BACKOFF_S, PROBE_BACKOFF_MAX_S, PROBE_MIN_S = 2.0, 10.0, 1.0
# A refused request waits for the server's Retry-After, else this backoff (doubling per
# refusal of the same request, with full jitter). It keeps its slot meanwhile, so the cap is a
# few seconds: the ceiling, not the wait, takes the load off a full server.
OVERLOAD_BACKOFF_S, OVERLOAD_BACKOFF_MAX_S = 0.5, 4.0
# The ceiling: a refusal cuts it to a tenth under what was in flight, at most once a second (a
# burst of refusals is one signal); it grows back each second without one (`Ceiling`), whatever
# the answers' length.
DECREASE = 0.9
CUT_EVERY_S = GROW_EVERY_S = 1.0
# Resend tokens: earned per first try and per answer (two: a server answering again gets its
# backlog back doubling each round trip, as TCP's slow start), the trickle that keeps a lone
# request going, the least cap (the in-flight limit raises it: a whole server's worth of
# resends may be out once it answers).
RETRY_RATIO = 0.2
ANSWER_TOKENS = 2.0
RETRY_FLOOR_PER_S = 1.0
RETRY_TOKENS_MAX = 20.0
# A hang: requests in flight and no reply of any kind for HANG_GAPS times the usual gap between
# replies (a high quantile of the last GAPS_KEPT gaps), at least FLEETGEN_HANG_AFTER_S; before
# any reply since the server was last idle, FIRST_REPLY_FACTOR times that (a thinking model's
# first answers may take minutes). Then a probe decides, within PROBE_TIMEOUT_S.
HANG_GAPS = 8.0
GAPS_KEPT = 256
GAP_QUANTILE = 0.99
FIRST_REPLY_FACTOR = 10.0
PROBE_TIMEOUT_S = 10.0


def label(exc: GenerationError) -> str:
    """How `status` names a request's end: `HTTP 500`, `timeout`, `reset`, `aborted`."""
    if exc.status is not None:
        return f"HTTP {exc.status}"
    text = exc.message.lower()
    if "aborted" in text:
        return "aborted"
    if "timed out" in text:
        return "timeout"
    return "reset"


class Outcomes:
    """Request ends over the last `window_s`, in one-second buckets of label counts."""

    def __init__(self, window_s: float = WINDOW_S, now: Callable[[], float] = time.monotonic) -> None:
        self.window_s = window_s
        self._now = now
        # (second, kind, label) -> count, one deque entry per second that saw a request.
        self._buckets: collections.deque[tuple[int, collections.Counter[tuple[str, str]]]] = (
            collections.deque())

    def add(self, kind: str, what: str = "") -> None:
        second = int(self._now())
        if not self._buckets or self._buckets[-1][0] != second:
            self._buckets.append((second, collections.Counter()))
        self._buckets[-1][1][(kind, what)] += 1
        self._trim(second)

    def counts(self) -> collections.Counter[tuple[str, str]]:
        self._trim(int(self._now()))
        total: collections.Counter[tuple[str, str]] = collections.Counter()
        for _, bucket in self._buckets:
            total.update(bucket)
        return total

    def _trim(self, second: int) -> None:
        while self._buckets and self._buckets[0][0] <= second - self.window_s:
            self._buckets.popleft()


class Ceiling:
    """A cap on requests in flight that overload refusals cut and quiet seconds grow back;
    lifted once it no longer binds.

    The first refusal of an episode says how many the server took (`good`: what was in flight
    less the refused one). A quiet second doubles the ceiling back up to that, then adds one:
    after an outage the server is full again within seconds, and at a server that refuses only
    beyond its slots the ceiling rises past them by one before the next refusal."""

    def __init__(self, now: Callable[[], float] = time.monotonic) -> None:
        self.value: int | None = None
        self.good = 1
        self._now = now
        self._changed_at = -math.inf

    def cut(self, in_flight: int, limit: int) -> int | None:
        """An overload refusal with `in_flight` requests out under `limit`: the new ceiling, or
        None when it was cut less than CUT_EVERY_S ago (the same burst)."""
        now = self._now()
        if self.value is not None and now - self._changed_at < CUT_EVERY_S:
            return None
        self._changed_at = now
        base = min(limit, max(1, in_flight), self.value or limit)
        if self.value is None:
            self.good = max(1, base - 1)
        self.value = max(1, min(base - 1, int(base * DECREASE)))
        return self.value

    def hold(self, value: int) -> None:
        """Start a ceiling at `value` (what is known to work) where none holds: the limit grows
        from there on quiet seconds instead of jumping to a far larger base."""
        if self.value is None:
            self.value = self.good = max(1, value)
            self._changed_at = self._now()

    def grow(self, limit: int) -> bool:
        """Called with each answer: True when the ceiling moved (or was lifted) because a
        second passed without a refusal."""
        if self.value is None:
            return False
        now = self._now()
        if now - self._changed_at < GROW_EVERY_S:
            return False
        self._changed_at = now
        self.value = min(2 * self.value, self.good) if self.value < self.good else self.value + 1
        if self.value >= limit:
            self.value = None
        return True


class RetryBudget:
    """Resend tokens for one server: first tries and answers earn them, resends spend them."""

    def __init__(self, ratio: float = RETRY_RATIO, floor_per_s: float = RETRY_FLOOR_PER_S,
                 cap: float = RETRY_TOKENS_MAX, now: Callable[[], float] = time.monotonic) -> None:
        self.ratio, self.floor_per_s, self.least_cap = ratio, floor_per_s, cap
        self.cap = cap
        self._now = now
        self.tokens = cap
        self._at = now()
        self.waited_s = 0.0

    def sized(self, limit: int) -> None:
        """The in-flight limit is `limit`: as many resends may be out at once."""
        self.cap = max(self.least_cap, float(limit))

    def first_try(self) -> None:
        self._earn(self.ratio)

    def answered(self) -> None:
        self._earn(ANSWER_TOKENS)

    def refill(self) -> None:
        """The server was shown to work (a probe answered while requests failed): the failures
        are the prompts' own, and their resends are not a storm against a sick server."""
        self.tokens = self.cap

    def take(self) -> float:
        """Take a token if there is one (0.0), else the seconds until the next one."""
        self._refill()
        if self.tokens >= 1.0 - 1e-9:  # ten fifths make one, float sums aside
            self.tokens -= 1.0
            return 0.0
        return (1.0 - self.tokens) / self.floor_per_s

    async def resend(self) -> None:
        """Wait for a resend token."""
        while (wait := self.take()) > 0:
            self.waited_s += wait
            await asyncio.sleep(wait)

    def _earn(self, tokens: float) -> None:
        if self.tokens < self.cap:
            self._refill()
            self.tokens = min(self.cap, self.tokens + tokens)

    def _refill(self) -> None:
        now = self._now()
        self.tokens = min(self.cap, self.tokens + (now - self._at) * self.floor_per_s)
        self._at = now


class Progress:
    """Whether a server with requests in flight is still giving anything back: the time of the
    last reply of any kind (an answer, a refusal, a failure) and the usual gap between replies.

    A server that accepts requests and answers `/health` but whose GPU hangs returns nothing at
    all; a working one returns something every gap or so, however long each answer takes. The
    gap's high quantile (not the answers' length) sets the wait, so a server running a hundred
    ten-minute answers is not suspected while its answers keep landing."""

    def __init__(self, floor_s: float, now: Callable[[], float] = time.monotonic) -> None:
        self.floor_s = floor_s
        self._now = now
        self.last_reply: float | None = None
        # When requests went out to an idle server (no reply yet since then), else None.
        self.busy_since: float | None = None
        self._gaps: collections.deque[float] = collections.deque(maxlen=GAPS_KEPT)
        self._usual_gap: float | None = None

    def sending(self, active: int) -> None:
        """A request goes out with `active` slots held before it: with none, a busy period
        starts."""
        if active == 0 and self.busy_since is None:
            self.busy_since = self._now()

    def replied(self, active: int) -> None:
        """A reply came back; `active` slots stay held after it (none: the server is idle, and
        the next request starts a new busy period)."""
        now = self._now()
        if self.last_reply is not None:
            self._gaps.append(now - self.last_reply)
            self._usual_gap = None
        if active == 0:
            self.last_reply = self.busy_since = None
        else:
            self.last_reply = now

    def usual_gap(self) -> float | None:
        """The high quantile of the gaps between replies, or None before there are any."""
        if self._usual_gap is None and self._gaps:
            ordered = sorted(self._gaps)
            self._usual_gap = ordered[min(len(ordered) - 1, int(GAP_QUANTILE * len(ordered)))]
        return self._usual_gap

    def stall_s(self) -> float:
        """How long nothing may come back before the server is probed as possibly hung."""
        gap = self.usual_gap()
        if self.last_reply is None:
            return self.floor_s * FIRST_REPLY_FACTOR
        return max(self.floor_s, HANG_GAPS * gap) if gap is not None else self.floor_s

    def quiet_s(self, active: int) -> float | None:
        """How long the server has returned nothing while requests were in flight, or None
        when nothing is in flight."""
        if active == 0:
            return None
        since = self.last_reply if self.last_reply is not None else self.busy_since
        return None if since is None else self._now() - since

    def heard(self) -> None:
        """The server answered a probe: it is alive, the quiet starts again."""
        self.last_reply = self._now()


@dataclass
class Rotation:
    """Whether the server takes work: out after EJECT_AFTER server-caused failures in a row (or
    a failed check), back when a probe is answered."""

    now: Callable[[], float] = time.monotonic
    in_rotation: bool = True
    out_since: float | None = None  # unix time, for `status`
    reason: str | None = None
    ejections: int = 0
    probes: int = 0
    failures_in_a_row: int = 0
    # Out because its supervisor is restarting it: back once it is seen restarted, not on
    # a probe (a draining server still refuses, which a probe takes for a full one).
    awaiting_restart: bool = False
    # When the newest-sent request that was answered was sent (monotonic): a prompt whose
    # tries all failed asks whether a request sent after its first try was answered. An answer
    # to a request sent earlier says nothing of the server since (an outage's onset).
    newest_answered_sent: float = float("-inf")
    # Why the server is suspect now (failures from many prompts), until a probe decides.
    suspicion: str | None = None
    # Probes that found the server working while its requests failed (poison prompts).
    checks_passed: int = 0
    # A server of servers (a router): suspect only while it answers nothing at all (a failing
    # backend fails the requests sent to it, and the router answers the rest).
    several: bool = False
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    # When requests were answered and when they failed, over the last FAILING_WINDOW_S.
    _answered: collections.deque[float] = field(default_factory=collections.deque)
    _failed: collections.deque[float] = field(default_factory=collections.deque)
    # The prompts whose requests make the current run of failures.
    _failing: set[str] = field(default_factory=set)

    def answered(self, sent_at: float | None = None) -> None:
        """A request answered (a reply or a refusal); `sent_at`: when it was sent, where known."""
        if sent_at is not None:
            self.newest_answered_sent = max(self.newest_answered_sent, sent_at)
        self.failures_in_a_row = 0
        self._failing.clear()
        now = self.now()
        self._answered.append(now)
        self._forget(now)

    def failed(self, what: str, running: int = 0, prompt: str | None = None) -> bool:
        """A server-caused failure of `prompt`'s request, with `running` requests out there
        now; True when the failures are evidence about the server (EJECT_AFTER in a row, from
        as many prompts, half of what it did lately): the caller then probes it and ejects it
        (`eject`) or clears it (`cleared`). A prompt failing again and again is one prompt."""
        self.failures_in_a_row += 1
        self._failing.add(prompt if prompt is not None else f"#{self.failures_in_a_row}")
        now = self.now()
        self._failed.append(now)
        self._forget(now)
        failed, seen = len(self._failed), len(self._failed) + len(self._answered) + running
        if (self.in_rotation and self.failures_in_a_row >= EJECT_AFTER
                and len(self._failing) >= EJECT_AFTER and failed >= FAILING_SHARE * seen
                and not (self.several and self._answered)):
            self.suspicion = (f"{self.failures_in_a_row} requests of {len(self._failing)} prompts "
                              f"failed in a row ({what}); {failed} failed, {len(self._answered)} "
                              f"answered in {FAILING_WINDOW_S:.0f} s, {running} running")
            return True
        return False

    def cleared(self) -> None:
        """A probe answered while requests failed: the failures were the prompts' own; the next
        suspicion needs a new run of them."""
        self.failures_in_a_row = 0
        self._failing.clear()
        self.suspicion = None
        self.checks_passed += 1

    def _forget(self, now: float) -> None:
        """Drop the answers and failures older than FAILING_WINDOW_S."""
        for times in (self._answered, self._failed):
            while times and now - times[0] > FAILING_WINDOW_S:
                times.popleft()

    def eject(self, reason: str) -> None:
        if not self.in_rotation:
            return
        self.in_rotation = False
        self.out_since = time.time()
        self.reason = reason
        self.ejections += 1
        self.probes = 0
        self.changed.set()

    def rejoin(self) -> None:
        self._answered.clear()
        self._failed.clear()
        self._failing.clear()
        self.suspicion = None
        self.in_rotation = True
        self.awaiting_restart = False
        self.out_since = None
        self.reason = None
        self.failures_in_a_row = 0
        self.changed.set()

    def next_probe_s(self) -> float:
        """The wait before the next probe: the one backoff policy, never under a second."""
        self.probes += 1
        return max(PROBE_MIN_S, backoff_delay(self.probes, PROBE_BACKOFF_S, PROBE_BACKOFF_MAX_S))


class ServerWatch:
    """One worker's view of its server: outcomes, rotation, overload ceiling, resend budget."""

    def __init__(self, hang_after_s: float = 30.0,
                 now: Callable[[], float] = time.monotonic) -> None:
        self.outcomes = Outcomes(now=now)
        self.rotation = Rotation(now=now)
        self.ceiling = Ceiling(now=now)
        self.budget = RetryBudget(now=now)
        self.progress = Progress(hang_after_s, now=now)
        # Why the limit is what it is, when an overload set it (`status`, the log).
        self.ceiling_reason: str | None = None

    def answered(self, limit: int, sent_at: float | None = None) -> bool:
        """A request answered (sent at `sent_at`, monotonic); True when the overload ceiling
        moved."""
        self.outcomes.add("answered")
        self.rotation.answered(sent_at)
        self.budget.answered()
        moved = self.ceiling.grow(limit)
        if moved:
            value = self.ceiling.value
            self.ceiling_reason = (None if value is None else
                                   f"{value} since the server refused requests for being full; "
                                   "growing back")
        return moved

    def overloaded(self, exc: OverloadedError, in_flight: int, limit: int) -> int | None:
        """A refusal for being full; the new ceiling when this one cut it."""
        what = label(exc)
        self.outcomes.add("overloaded", what)
        cut = self.ceiling.cut(in_flight, limit)
        if cut is not None:
            self.ceiling_reason = f"cut to {cut} after {what} (server full)"
        return cut

    def failed(self, exc: GenerationError, running: int = 0, prompt: str | None = None) -> bool:
        """A server-caused failure of `prompt`'s request with `running` requests out; True when
        the server is suspect (Rotation.failed)."""
        what = label(exc)
        self.outcomes.add("failed", what)
        return self.rotation.failed(what, running, prompt)

    def refused(self, exc: GenerationError) -> None:
        """A 4xx: the server works, the request (or the job) is at fault."""
        self.outcomes.add("refused", label(exc))
        self.rotation.answered()

    def overload_wait_s(self, exc: OverloadedError, refusals: int) -> float:
        """How long a refused request waits before it is sent again."""
        if exc.retry_after_s is not None:
            # Spread the herd the header would line up: up to a tenth more.
            return exc.retry_after_s * random.uniform(1.0, 1.1)
        return backoff_delay(refusals, OVERLOAD_BACKOFF_S, OVERLOAD_BACKOFF_MAX_S)

    def health(self, limit: int, limit_reason: str | None) -> ServerHealth:
        counts = self.outcomes.counts()
        by: dict[str, dict[str, int]] = {"answered": {}, "overloaded": {}, "failed": {},
                                         "refused": {}}
        for (kind, what), n in counts.items():
            by[kind][what or "ok"] = by[kind].get(what or "ok", 0) + n
        rotation = self.rotation
        return ServerHealth(
            window_s=self.outcomes.window_s,
            answered=sum(by["answered"].values()),
            failed=by["failed"], refused=by["refused"], overloaded=by["overloaded"],
            in_rotation=rotation.in_rotation, out_since=rotation.out_since,
            out_reason=rotation.reason, ejections=rotation.ejections,
            limit=limit, limit_reason=self.ceiling_reason or limit_reason,
        )

"""How many requests the worker keeps in flight at its server, in one place: the limiter that
holds them, what the limit is sized from, and the controllers that find it for a server that
does not say what it runs.

All batches of the process share one `Limiter`, sized from what the server really runs at once
(plus a small margin), so when one batch's tail drains, the next batch's prompts take the free
slots: the server stays full across batch boundaries. `InFlight` sets its size; where the
figure comes from depends on the server's kind (fleetgen/servers), one way each
(`FLEETGEN_MAX_IN_FLIGHT` beats them all):

- SGLang's `/server_info` states the effective concurrency: the worker keeps that plus a small
  queue margin in flight (fleetgen/servers/_server_info.py). No controller.
- `QueueWatch`, for a server whose `/metrics` shows requests running and waiting (vLLM, an
  SGLang without `/server_info`): the limit doubles each tick while everything sent runs at
  once; once requests wait, what runs beside them is the server's capacity, and the limit is
  that plus the queue margin.
- `QueueProbe`, for a server that shows nothing (TGI, `transformers serve`, a router, a hosted
  endpoint): a one-token request a second, timed. Answers differ 100x in length and a long one
  says nothing for a minute; a probe's wait says within a second whether requests queue at
  the server, and with the answer rate, how many. The limit grows by half a probe until one
  waits (so it never passes 1.5 times the server's capacity), then sits at the measured
  capacity plus the queue margin, and follows a capacity that falls at the next probe. While
  probes find free slots it probes five times a second (workers/load.py), so a large server
  fills within seconds.

Overload refusals (429, 503) cap all three from above (workers/flow.py `Ceiling`).

Each controller is fed by the load watch (workers/load.py) and answers with the new limit;
`how` says, for `status` and the worker's log, how the limit was found.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import logging
import math
import statistics
import time
from collections.abc import AsyncIterator, Callable

from fleetgen.errors import OverloadedError
from fleetgen.servers import CONFIGURED, Server, ServerCapacity, stated_capacity
from fleetgen.settings import Settings
from workers import metrics
from workers.flow import ServerWatch

log = logging.getLogger(__name__)
# Where limit changes are told: INFO, whatever the worker's log level (like the ready line).
changes_log = logging.getLogger(f"{__name__}.changes")
changes_log.setLevel(logging.INFO)

# Limits the controllers start from: small enough for a CPU server, large enough that a GPU
# server's slots fill within a few seconds.
QUEUE_WATCH_START = 8
PROBE_START = 8
MAX_LIMIT = 8192
# While ramping, the probe controller grows the limit by this factor a probe: once a probe
# waits, at most this many times the server's capacity is in flight.
RAMP = 1.5
# Past the ramp, a probe that did not wait while requests were ready grows the limit by this
# share of it: a server whose capacity rose fills again within a few probes.
REGROW_SHARE = 4
# A probe that took longer than the fastest by more than the fastest (and by at least this)
# waited for a slot.
QUEUED_S = 0.05
# Before any answer has come back, a probe waited for a slot only if it took this many times
# the fastest probe and this long: a GPU server's steps grow a few times longer from a handful of
# requests to a full batch, and a slot of a server running long answers frees every tenth of a
# second or more.
RAMP_WAIT_FACTOR, RAMP_WAIT_S = 4.0, 0.25
# The probe controller's capacity is the median of this many estimates (one a waiting probe).
ESTIMATES = 5
# Behind a router, the last this many probes vote: most waited, the router is full.
VOTES = 5
# An estimate under this share of the capacity is a capacity that fell, not noise.
FALLEN = 0.75
# QueueWatch remembers the running count of this many ticks with a queue (a scheduler admits
# at step boundaries, so one tick may catch a slot between two requests).
QUEUE_MEMORY = 10
# The answer rate a probe's wait is multiplied by is measured over this window.
ANSWER_RATE_S = 10.0
# The worker logs a change of its in-flight limit at most this often (the newest is kept).
LIMIT_LOG_EVERY_S = 10.0


class QueueWatch:
    """The limit from the server's own running and waiting gauges."""

    def __init__(self, margin: Callable[[int], int], start: int = QUEUE_WATCH_START) -> None:
        self.limit = start
        self.capacity: int | None = None
        self._margin = margin
        self._queued: collections.deque[int] = collections.deque(maxlen=QUEUE_MEMORY)
        self.how = f"growing from {start}: no request has waited yet (/metrics)"

    def on_load(self, running: float, waiting: float, saturated: bool) -> int:
        """One reading of the gauges; `saturated`: the worker had a request ready for every
        free slot of its limit since the last reading."""
        if waiting > 0 and running > 0:
            self._queued.append(int(running))
            self.capacity = max(self._queued)
            self.limit = min(MAX_LIMIT, self.capacity + self._margin(self.capacity))
            self.how = (f"/metrics: {self.capacity} running while {int(waiting)} waited; "
                        f"keeping {self.limit} in flight")
        elif saturated and waiting == 0 and running > 0:
            grown = self.limit * 2 if self.capacity is None else self.limit + max(1, self.limit // 8)
            self.limit = min(MAX_LIMIT, grown)
            if self.capacity is None:
                self.how = (f"/metrics: {int(running)} running, none waiting; growing to "
                            f"{self.limit}")
        return self.limit


class QueueProbe:
    """The limit from how long a one-token request waits at the server (no capacity endpoint,
    no load gauges): the load watch sends one a second while requests are in flight.

    A server with a free slot starts a new request at its next step, so the probe comes back in
    about the time of the fastest probe seen; a full server queues it until a slot frees. The
    first probe that waits ends the ramp (the limit grew by RAMP a probe, so it is then at most
    RAMP times what the server runs); from then on, what waited says how many requests queue
    ahead of it — the wait times the rate answers come back — and the server's capacity is what
    is in flight less that queue. The limit is that capacity plus the queue margin, and grows
    slowly while no probe waits and the worker has requests ready.

    Behind a router (`several`), a probe lands on one backend of several: one waiting says that
    backend is full, not the router. There the limit is sized down only when most of the last
    VOTES probes waited, and grows while most find a free slot: a least-in-flight router over
    unequal backends is kept full on its largest one, not sized by its smallest.
    """

    def __init__(self, margin: Callable[[int], int], start: int = PROBE_START,
                 idle_s: float | None = None, several: bool = False) -> None:
        self.limit = start
        self._several = several
        self._votes: collections.deque[bool] = collections.deque(maxlen=VOTES)
        self.capacity: int | None = None
        self._margin = margin
        self._ramping = True
        # Whether the last probe grew the limit: the load watch then probes faster.
        self.growing = True
        # The fastest probe: at first an idle server's answer (`idle_s`, timed before any
        # request was sent), so even the first probe under load can tell a wait.
        self.fastest = idle_s
        self._estimates: collections.deque[int] = collections.deque(maxlen=ESTIMATES)
        self.how = f"measuring: starting at {start} (the server states no capacity)"

    def on_probe(self, latency_s: float, in_flight: int, saturated: bool,
                 answers_per_s: float) -> int:
        """One probe's latency, taken with `in_flight` requests out; `saturated`: a request
        waited for a slot since the last probe; `answers_per_s`: the recent answer rate."""
        fastest = latency_s if self.fastest is None else min(self.fastest, latency_s)
        self.fastest = fastest
        wait = latency_s - fastest
        # The probe waited for one slot to free per request queued ahead of it, then for its
        # own. Before any answer, only how long it waited is known: a wait many times the
        # fastest probe is a queue; a few times it may be longer steps of a busier server.
        ahead = max(0.0, wait * answers_per_s - 1) if answers_per_s > 0 else None
        waited = (wait > max(RAMP_WAIT_FACTOR * fastest, RAMP_WAIT_S) if ahead is None
                  else wait > max(fastest, QUEUED_S) and ahead >= 0.5)
        self.growing = not waited and saturated
        self._votes.append(waited)
        if waited and self._several and 2 * sum(self._votes) <= VOTES:
            self.how = (f"probe waited at {in_flight} in flight, as {sum(self._votes)} of the "
                        f"last {len(self._votes)} did: one backend full, not the router")
            waited = False
        if (waited and not saturated and self.capacity is not None
                and in_flight - (ahead or 0) < self.capacity):
            # Nothing of the worker's waited for a slot: fewer requests are out because fewer
            # are left (a draining job), and a busier step than the idle one's reads as a
            # short wait. That is not a smaller server: its measured capacity holds.
            self.how = (f"probe slower at {in_flight} in flight with none waiting here; keeping "
                        f"~{self.capacity} measured")
        elif waited:
            self._ramping = False
            if ahead is not None and in_flight > 0:
                estimate = max(1, round(in_flight - ahead))
                if self.capacity is not None and estimate < self.capacity * FALLEN:
                    self._estimates.clear()  # the server lost capacity: follow it now
                self._estimates.append(estimate)
                self.capacity = int(statistics.median(self._estimates))
                self.limit = min(MAX_LIMIT, self.capacity + self._margin(self.capacity))
                self.how = (f"probe: ~{ahead:.0f} of {in_flight} in flight waited at the server, "
                            f"so it runs ~{self.capacity} at once; keeping {self.limit}")
            else:
                self.how = f"probe waited {wait:.2f}s at {in_flight} in flight; holding {self.limit}"
        elif saturated:
            grown = (math.ceil(self.limit * RAMP) if self._ramping
                     else self.limit + max(1, self.limit // REGROW_SHARE))
            self.limit = min(MAX_LIMIT, grown)
            self.how = (f"probe: no wait at {in_flight} in flight; growing to {self.limit}"
                        + (f" (~{self.capacity} measured)" if self.capacity else ""))
        return self.limit


def queue_margin(settings: Settings, capacity: int) -> int:
    """Requests kept waiting at the server beyond what it runs, so no slot idles while the next
    request travels."""
    return max(settings.queue_margin, int(capacity * settings.queue_margin_ratio))


class Limiter:
    """A semaphore whose size can change while requests hold it; waiters are served in order.

    A slot is one answer in flight, not one request: a request that asks several answers of
    a prompt (`n`) holds one slot per answer (`slots`), as the engine runs each as a request
    of its own (SGLang and vLLM expand `n` into n running requests). One that asks more
    answers than the limit goes alone, once nothing else holds a slot.

    A freed slot is handed to the first waiter directly (counted before it wakes), so one
    release wakes one task and no newcomer can take the slot first. asyncio's Semaphore does
    the same but cannot be resized; an asyncio.Condition costs more CPU per request.
    """

    def __init__(self, limit: int) -> None:
        self.limit = max(1, limit)
        self.active = 0
        self._waiters: collections.deque[tuple[asyncio.Future[None], int]] = collections.deque()
        # Set whenever a request had to wait for a slot; the capacity controllers read and
        # clear it (a limit nobody waited for says nothing about the server).
        self.waited = False

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    async def __aenter__(self) -> None:
        await self.acquire(1)

    async def __aexit__(self, *exc: object) -> None:
        self.release(1)

    @contextlib.asynccontextmanager
    async def slots(self, count: int) -> AsyncIterator[None]:
        """Hold `count` slots: one request of `count` answers."""
        await self.acquire(count)
        try:
            yield
        finally:
            self.release(count)

    async def acquire(self, count: int) -> None:
        if not self._waiters and self._fits(count):  # nobody waits: take the slots at once
            self.active += count
            return
        self.waited = True
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (waiter, count)
        self._waiters.append(entry)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self.release(count)  # handed the slots as it was cancelled: pass them on
            else:
                with contextlib.suppress(ValueError):
                    self._waiters.remove(entry)
            raise

    def release(self, count: int) -> None:
        self.active -= count
        self._hand_over()

    async def requeue(self, count: int) -> None:
        """Holding `count` slots while the limit was cut below what is held: give them up and
        wait in line for them again (still holding them afterwards, however this ends, for the
        holder's own release)."""
        if self.active <= self.limit:
            return
        self.release(count)
        try:
            await self.acquire(count)
        except BaseException:
            self.active += count  # not handed them: the holder releases what it took at first
            raise

    async def set_limit(self, limit: int) -> None:
        self.limit = max(1, limit)
        self._hand_over()

    def resize(self) -> None:
        """Hand slots to waiters after `limit` was raised from the loop's own thread."""
        self._hand_over()

    def _fits(self, count: int) -> bool:
        return self.active + count <= self.limit or self.active == 0

    def _hand_over(self) -> None:
        while self._waiters:
            waiter, count = self._waiters[0]
            if waiter.done():  # a cancelled waiter is skipped
                self._waiters.popleft()
                continue
            if not self._fits(count):
                return
            self._waiters.popleft()
            self.active += count
            waiter.set_result(None)



class InFlight:
    """The worker's in-flight limit at its server: the limiter every request holds slots of,
    sized from what the server states (`found`) or from its controller's measure (`on_load`,
    `on_probe`), under the overload ceiling (`overloaded`, `answered`)."""

    def __init__(self, settings: Settings, worker: str, server_url: str,
                 watch: ServerWatch) -> None:
        self._settings = settings
        self._worker = worker
        self._server_url = server_url
        # Its overload ceiling caps the limit; the server's answers lift it again.
        self._watch = watch
        # Start at 1 in flight until the server says what it can take.
        self._limiter = Limiter(1)
        self._margin = functools.partial(queue_margin, settings)
        # What the limit is sized from, as `status` shows it; None until the server is found.
        self.capacity: ServerCapacity | None = None
        # Finds the limit of a server that does not state it; None when it does.
        self.control: QueueWatch | QueueProbe | None = None
        # The limit the server's capacity calls for, before the overload ceiling.
        self._base = 1
        self._answers: collections.deque[float] = collections.deque()
        # A probe's latency at an idle server (the probe controller's reference).
        self.idle_probe_s: float | None = None
        # The endpoint has a request budget: sized from answers and refusals, never probes.
        self._budget: ServerCapacity | None = None
        # When the limit was last logged, and what it was then.
        self._logged = (-LIMIT_LOG_EVERY_S, 1)

    @property
    def limit(self) -> int:
        return self._limiter.limit

    @property
    def active(self) -> int:
        """Slots held now: answers in flight at the server."""
        return self._limiter.active

    def slots(self, count: int) -> contextlib.AbstractAsyncContextManager[None]:
        """Hold `count` slots (one request of `count` answers), waiting in turn for them."""
        return self._limiter.slots(count)

    async def requeue(self, count: int) -> None:
        """A request refused for a full server, about to go again, holding `count` slots: over
        a ceiling cut meanwhile, it waits in line for them again."""
        await self._limiter.requeue(count)

    def wants_idle_probe(self, server: Server) -> bool:
        """Whether the server's limit is to be found by timing probes and no controller does it
        yet: a probe at the idle server is then timed first, the controller's reference."""
        return (self.control is None and not self._settings.max_in_flight
                and self._budget is None and not server.kind.reads_load
                and (server.info is None or stated_capacity(server.info) is None))

    def found(self, server: Server) -> ServerCapacity:
        """The server as found now (at first contact, at each refresh): size the limit from what
        it states, or leave it to the controller that measures it."""
        capacity = self._capacity(server)
        # A router's failures are its backends' while it answers others (flow.py Rotation).
        self._watch.rotation.several = server.kind.several
        if self.control is not None:  # measured: the controller moves the limit, not this
            self._apply(self.control.limit)
            return capacity
        # The operator's number (or 1) gets no margin: it is not a guess.
        limit = (capacity.effective if capacity.configured
                 else capacity.effective + self._margin(capacity.effective))
        if self.capacity is None or (capacity.effective, capacity.source) != (
                self.capacity.effective, self.capacity.source):
            log.log(logging.WARNING if capacity.configured and not self._settings.max_in_flight
                    else logging.INFO,
                    "worker %s: %s is %s; %s; keeping %d in flight", self._worker,
                    self._server_url, server.describe(), capacity.source, limit)
        self.capacity = capacity
        self._apply(limit)
        return capacity

    def _capacity(self, server: Server) -> ServerCapacity:
        """What the server runs at once: the operator's number, what the server states, or the
        controller's measure (the controller is made here, for the server's kind)."""
        if self._settings.max_in_flight:
            n = self._settings.max_in_flight
            return ServerCapacity(n, None, f"{CONFIGURED}={n}", configured=True)
        stated = stated_capacity(server.info) if server.info is not None else None
        if stated is not None:
            self.control = None
            return stated
        if self._budget is not None:
            return self._budget
        if self.control is None:
            self.control = (QueueWatch(self._margin) if server.kind.reads_load
                            else QueueProbe(self._margin, idle_s=self.idle_probe_s,
                                            several=server.kind.several))
            log.info("worker %s: %s (%s) does not state how many requests it runs at once; "
                     "finding it %s", self._worker, self._server_url, server.describe(),
                     "from its queue gauges" if isinstance(self.control, QueueWatch)
                     else "by timing a one-token probe a second")
        return ServerCapacity(self.control.limit, None, self.control.how, configured=False)

    def _apply(self, base: int) -> None:
        """The limiter's size: what the server's capacity calls for (`base`), under the overload
        ceiling while one holds; a controller's measure is published as the capacity. A change
        is logged at most every LIMIT_LOG_EVERY_S."""
        self._base = max(1, base)
        control = self.control
        if control is not None:
            self.capacity = ServerCapacity(control.capacity or base, None, control.how,
                                           configured=False)
        ceiling = self._watch.ceiling.value
        limit = self._base if ceiling is None else min(self._base, ceiling)
        limiter = self._limiter
        before = limiter.limit
        limiter.limit = max(1, limit)
        limiter.resize()
        # As many resends may be out at once as requests (flow.py RetryBudget).
        self._watch.budget.sized(limiter.limit)
        capacity = self.capacity.effective if self.capacity else limit
        metrics.set_server_capacity(self._worker, self._server_url, capacity, limiter.limit)
        if limiter.limit != before:
            self.log_change()

    def log_change(self) -> None:
        """Log the limit if it changed since it was last logged, at most every
        LIMIT_LOG_EVERY_S (the registry beat calls again, so the newest is logged)."""
        now = time.monotonic()
        last_at, last_limit = self._logged
        limit = self._limiter.limit
        if now - last_at >= LIMIT_LOG_EVERY_S and limit != last_limit:
            self._logged = (now, limit)
            changes_log.info("worker %s: in flight up to %d (was %d): %s", self._worker,
                             limit, last_limit, self.reason)

    @property
    def reason(self) -> str:
        """Why the limit is what it is, in a few words (`status`, the log)."""
        watch = self._watch
        ceiling = watch.ceiling.value
        if ceiling is not None and ceiling < self._base and watch.ceiling_reason:
            return watch.ceiling_reason
        return self.capacity.source if self.capacity else "not found yet"

    def answered(self, sent_at: float | None = None) -> None:
        """A request was answered (any 200; sent at `sent_at`, monotonic): counted for the
        answer rate; the ceiling may lift."""
        now = time.monotonic()
        self._answers.append(now)
        while self._answers and now - self._answers[0] > ANSWER_RATE_S:
            self._answers.popleft()
        if self._watch.answered(self._base, sent_at):
            self._apply(self._base)

    def overloaded(self, exc: OverloadedError, refusals: int) -> float:
        """A request refused for a full server: cut the ceiling, count it; the seconds it waits
        before it is sent again."""
        if self._watch.overloaded(exc, self._limiter.active, self._base) is not None:
            self._apply(self._base)
        metrics.request_refused(self._worker, self._server_url, "overloaded", exc.status)
        return self._watch.overload_wait_s(exc, refusals)

    def on_load(self, running: float, waiting: float) -> None:
        """One reading of the server's running and waiting gauges, for its QueueWatch."""
        control = self.control
        if not isinstance(control, QueueWatch):
            return
        limiter = self._limiter
        saturated = limiter.waited or limiter.active >= limiter.limit
        limiter.waited = False
        before = control.capacity, control.limit
        limit = control.on_load(running, waiting, saturated)
        if control.capacity != before[0] or (control.capacity is None and limit != before[1]):
            log.info("worker %s: %s", self._worker, control.how)
        self._apply(limit)

    def on_probe(self, latency_s: float, in_flight: int) -> None:
        """One probe's latency, sent with `in_flight` answers out, for its QueueProbe."""
        control = self.control
        if not isinstance(control, QueueProbe):
            return
        limiter = self._limiter
        saturated = limiter.waited or limiter.waiting > 0
        limiter.waited = False
        now = time.monotonic()
        while self._answers and now - self._answers[0] > ANSWER_RATE_S:
            self._answers.popleft()
        before = control.capacity
        limit = control.on_probe(latency_s, in_flight, saturated,
                                 len(self._answers) / ANSWER_RATE_S)
        if control.capacity != before:
            log.info("worker %s: %s", self._worker, control.how)
        self._apply(limit)

    def budgeted(self, per_window: int | None) -> None:
        """The endpoint states a request budget (a hosted one): stop timing probes, which would
        spend it, and keep what it allows in flight (its requests per window, else, when the
        figure is not a number, what is in flight now, grown back by its answers), cut by its
        429s (the ceiling)."""
        if self._budget is not None or isinstance(self.control, QueueWatch):
            return
        base = min(MAX_LIMIT, per_window or MAX_LIMIT)
        how = (f"a request budget of {per_window} per window: up to that in flight, cut by its "
               "429s" if per_window else "a request budget it states without a figure: grown "
               "on answers, cut by its 429s, no timing probes")
        self._budget = ServerCapacity(base, None, how, configured=False)
        self.control = None
        self.capacity = self._budget
        log.info("worker %s: %s has %s", self._worker, self._server_url, how)
        if not per_window:
            # No figure to go by: from what runs now, grown each quiet second (the ceiling),
            # never a jump to the largest limit. A stated budget is kept in flight at once.
            self._watch.ceiling.hold(max(self.limit, PROBE_START))
        self._apply(base + self._margin(base))  # as `found` keeps it at the next refresh

    def forget(self, *, restarted: bool) -> None:
        """What was measured of the server holds no more. Another server (another kind, other
        models): its limit is found anew. The same one restarted: the overload ceiling is
        dropped, and a limit measured by probes is measured again from the ramp's start, so
        the requests waiting for the server go back at that, not at the old server's (the idle
        probe's time is kept)."""
        if not restarted:
            self.control = None
            return
        self._watch.ceiling.value = None
        if isinstance(self.control, QueueProbe):
            self.control = None
            self._apply(PROBE_START)

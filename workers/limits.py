"""How many requests the worker keeps in flight when the server does not say what it runs.

Three ways, one per what the server offers (the engine picks; `FLEETGEN_MAX_IN_FLIGHT` beats
them all):

- SGLang's `/server_info` states the effective concurrency: the worker keeps that plus a small
  queue margin in flight (fleetgen/servers/_server_info.py). No controller here.
- `QueueWatch`, for a server whose `/metrics` shows requests running and waiting (vLLM, an
  SGLang without `/server_info`): the limit doubles each tick while everything sent runs at
  once; once requests wait, what runs beside them is the server's capacity, and the limit is
  that plus the queue margin.
- `QueueProbe`, for a server that shows nothing (TGI, `transformers serve`, a router, a hosted
  endpoint): a one-token request a second, timed. Answers differ 100x in length and a long one
  says nothing for a minute; a probe's wait says within a second whether requests queue at
  the server, and with the answer rate, how many. The limit grows by half a probe until one
  waits (so it never passes 1.5 times the server's capacity), then sits at the measured
  capacity plus the queue margin, and follows a capacity that falls at the next probe.

Overload refusals (429, 503) cap all three from above (workers/flow.py `Ceiling`).

Each controller is fed by the engine and answers with the new limit; `how` says, for `status`
and the worker's log, how the limit was found.
"""

from __future__ import annotations

import collections
import math
import statistics
from collections.abc import Callable

# Limits the controllers start from: small enough for a CPU server, large enough that a GPU
# server's slots fill within a few seconds.
QUEUE_WATCH_START = 8
PROBE_START = 8
MAX_LIMIT = 8192
# While ramping, the probe controller grows the limit by this factor a probe: once a probe
# waits, at most this many times the server's capacity is in flight.
RAMP = 1.5
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
# An estimate under this share of the capacity is a capacity that fell, not noise.
FALLEN = 0.75
# QueueWatch remembers the running count of this many ticks with a queue (a scheduler admits
# at step boundaries, so one tick may catch a slot between two requests).
QUEUE_MEMORY = 10


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
    no load gauges): the engine sends one a second while requests are in flight.

    A server with a free slot starts a new request at its next step, so the probe comes back in
    about the time of the fastest probe seen; a full server queues it until a slot frees. The
    first probe that waits ends the ramp (the limit grew by RAMP a probe, so it is then at most
    RAMP times what the server runs); from then on, what waited says how many requests queue
    ahead of it — the wait times the rate answers come back — and the server's capacity is what
    is in flight less that queue. The limit is that capacity plus the queue margin, and grows
    slowly while no probe waits and the worker has requests ready.
    """

    def __init__(self, margin: Callable[[int], int], start: int = PROBE_START,
                 idle_s: float | None = None) -> None:
        self.limit = start
        self.capacity: int | None = None
        self._margin = margin
        self._ramping = True
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
        if waited:
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
                     else self.limit + max(1, self.limit // 16))
            self.limit = min(MAX_LIMIT, grown)
            self.how = (f"probe: no wait at {in_flight} in flight; growing to {self.limit}"
                        + (f" (~{self.capacity} measured)" if self.capacity else ""))
        return self.limit

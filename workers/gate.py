"""Stop taking batches while the local server is not ready; take them again when it is.

A consumer bootstep (docs/development/delivery.md#health-gate): the worker's backend probes
`/health` on its loop (workers/healthcheck.py); the worker's timer cancels or re-adds the queue consumers from that reading.
Batches wait in Redis meanwhile, so none is failed or burned because its server was down.
"""

from __future__ import annotations

import collections
import logging
import math
import time
from typing import Any

from celery import bootsteps

from fleetgen import keys
from workers.backlog import Backlog
from workers.runtime import runtime

log = logging.getLogger(__name__)

# Consecutive failed probes before the gate closes: one slow /health under load is no outage.
CLOSE_AFTER_FAILURES = 2
# Also how often the feed is adjusted: a batch is fetched well before the server drains.
CHECK_EVERY_S = 0.05
# Unsent prompts a worker keeps in reserve: what its server takes in this long. Fetching the
# next batch (broker delivery, input read, checkpoint read) takes ~0.2 s; a larger reserve
# only leaves more prompts stranded on one worker when the queue runs dry at the job's end,
# while other GPUs idle (the job's tail in tests/perf).
RESERVE_S = 1.0
# The sending rate is measured over this window.
RATE_WINDOW_S = 3.0
MIN_RESERVE = 4


class ServerGate(bootsteps.StartStopStep):
    requires = frozenset({"celery.worker.consumer.tasks:Tasks"})

    def __init__(self, parent: Any, **kwargs: Any) -> None:
        super().__init__(parent, **kwargs)
        self.tref: Any = None
        self.closed_since: float | None = None
        # Whether the last closing was logged: not before the server was ever usable, when the
        # worker's start line already says why it waits (workers/discovery.py).
        self.told_closed = False
        self.paused_s_total = 0.0
        self.rate = SendRate(RATE_WINDOW_S)

    def start(self, c: Any) -> None:
        # Celery would prefetch one batch per pool thread; start with one and let _feed decide.
        _set_prefetch(c, 1)
        self.tref = c.timer.call_repeatedly(CHECK_EVERY_S, self._apply, (c,), priority=10)

    def stop(self, c: Any) -> None:
        if self.tref is not None:
            self.tref.cancel()
            self.tref = None

    def _apply(self, c: Any) -> None:
        backend, backlog = runtime.backend, runtime.backlog
        if backend is None or backlog is None or c.task_consumer is None:
            return
        checks = backend.checks
        self._feed(c, backlog, backend.in_flight.limit,
                   healthy=checks.failures == 0 and checks.in_rotation)
        # A server out of rotation (failing what it is sent) takes nothing until a probe is
        # answered: its batches run on the other workers meanwhile.
        ready = checks.failures < CLOSE_AFTER_FAILURES and checks.in_rotation
        active = {q.name for q in c.task_consumer.queues}
        wanted = [q for q in runtime.queues if q] or [keys.SHARED_QUEUE]
        if not ready and active:
            for queue in list(active):
                c.cancel_task_queue(queue)
            self.closed_since = time.monotonic()
            self.told_closed = backend.discovery.usable
            if self.told_closed:
                log.warning("worker %s: %s %s; stopped taking batches", runtime.worker,
                            runtime.server_url,
                            "not ready" if checks.in_rotation else "out of rotation")
        elif ready and not active:
            for queue in wanted:
                c.add_task_queue(queue)
            paused = time.monotonic() - (self.closed_since or time.monotonic())
            self.paused_s_total += paused
            if self.told_closed:
                log.warning("worker %s: %s ready again after %.1fs; taking batches",
                            runtime.worker, runtime.server_url, paused)
            self.closed_since = None

    def _feed(self, c: Any, backlog: Backlog, limit: int, *, healthy: bool) -> None:
        """Allow one more batch only when the prompts in hand are about to run out. A server
        that failed its last probe or a request gets nothing more: batches taken now would
        wait here while a healthy GPU could run them."""
        assert runtime.settings is not None
        low_water = reserve(self.rate.update(time.monotonic(), backlog.sent), limit)
        _set_prefetch(c, wanted_prefetch(
            batches=backlog.batches, held=held_on_channel(c), loading=backlog.loading,
            unsent=backlog.unsent, low_water=low_water, healthy=healthy,
            cap=runtime.settings.batch_concurrency))


def wanted_prefetch(*, batches: int, held: int | None, loading: int, unsent: int,
                    low_water: int, healthy: bool, cap: int) -> int:
    """The prefetch that lets exactly one more batch in when the prompts in hand run low.

    Prefetch bounds the messages unacked *on the consumer's channel*. After a broker
    reconnect the batches still running from the old connection are no longer on it (Redis
    restored their messages to the queue), so counting them (`batches`) would open room for as
    many new batches at once: only those the channel holds (`held`) count.
    """
    hungry = healthy and loading == 0 and unsent < low_water
    on_channel = batches if held is None else min(batches, held)
    return max(1, min(on_channel + (1 if hungry else 0), cap))


def held_on_channel(c: Any) -> int | None:
    """Messages delivered on the consumer's current channel and not acked yet (kombu's virtual
    QoS, the Redis transport's), or None where that is not known."""
    qos: Any = getattr(getattr(c.task_consumer, "channel", None), "qos", None)
    pcount = getattr(qos, "prefetch_count", 0)
    if qos is None or not pcount or not hasattr(qos, "can_consume_max_estimate"):
        return None
    return max(0, int(pcount) - int(qos.can_consume_max_estimate() or 0))


def reserve(per_s: float | None, limit: int) -> int:
    """Unsent prompts to keep in hand: RESERVE_S of sending, between a handful and a server's
    worth (`limit`); a server's worth until the rate is known."""
    if per_s is None:
        return limit
    return min(limit, max(MIN_RESERVE, math.ceil(per_s * RESERVE_S)))


class SendRate:
    """Prompts sent per second over a sliding window, from a cumulative count."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._points: collections.deque[tuple[float, int]] = collections.deque()

    def update(self, now: float, total: int) -> float | None:
        """The rate, or None until the window has half filled."""
        points = self._points
        points.append((now, total))
        while len(points) > 2 and now - points[1][0] >= self.window_s:
            points.popleft()
        (t0, n0) = points[0]
        if now - t0 < self.window_s / 2:
            return None
        return (total - n0) / (now - t0)


def _set_prefetch(c: Any, count: int) -> None:
    """Set the consumer's prefetch; `value` too, or Celery's loop restores its own number."""
    with c.qos._mutex:
        c.qos.value = count
    c.qos.set(count)

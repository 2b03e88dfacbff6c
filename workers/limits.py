"""How many requests the worker keeps in flight when the server does not say what it runs.

Three ways, one per what the server offers (the engine picks; `FLEETGEN_MAX_IN_FLIGHT` beats
them all):

- SGLang's `/server_info` states the effective concurrency: the worker keeps that plus a small
  queue margin in flight (fleetgen/server_info.py). No controller here.
- `QueueWatch`, for a server whose `/metrics` shows requests running and waiting (vLLM, an
  SGLang without `/server_info`): the limit doubles each tick while everything sent runs at
  once; once requests wait, what runs beside them is the server's capacity, and the limit is
  that plus the queue margin.
- `Gradient`, for a server that shows nothing (TGI, `transformers serve`, a router, a hosted
  endpoint): the gradient controller of Netflix's concurrency-limits and Envoy's adaptive
  concurrency filter, judged on latency per output token (answers differ 100x in length, so
  latency per request says nothing). Below the server's capacity more requests cost little
  latency per token; past it they queue, and latency per token grows in proportion. The limit
  doubles while latency per token stays within FLAT of the best seen, then grows by sqrt(limit) per
  window, and shrinks in proportion once latency per token exceeds TOLERANCE times the best.
  So it settles between one and TOLERANCE times the server's capacity: a few requests queue
  at the server, none of its slots idles, and an offline job loses nothing by that queue.

Each controller is fed by the engine and answers with the new limit; `how` says, for `status`
and the worker's log, how the limit was found.
"""

from __future__ import annotations

import collections
import math
import time
from collections.abc import Callable

# Limits the controllers start from: small enough for a CPU server, large enough that a GPU
# server's slots fill within a few windows.
QUEUE_WATCH_START = 8
GRADIENT_START = 8
MAX_LIMIT = 8192
# Latency per output token this many times the best seen means requests queue at the server.
TOLERANCE = 2.0
# While doubling, latency per token within this factor of the best is "flat": a GPU server
# bound by its per-step overhead gives each token ~1.25x the time at 16 requests as at 4, and
# about the same at 128.
FLAT = 1.5
# A window of the gradient controller: WINDOW_MIN answers while the limit doubles, then about
# half the limit (at most WINDOW_MAX), so each judgement covers answers of many lengths.
WINDOW_MIN, WINDOW_MAX = 4, 64
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


class Gradient:
    """The limit from latency per output token (no capacity endpoint, no load metrics)."""

    def __init__(self, start: int = GRADIENT_START,
                 now: Callable[[], float] = time.monotonic) -> None:
        self.limit = start
        self._now = now
        self.best: float | None = None  # seconds per output token, the lowest window
        # Whether the last doubling's window was already above FLAT: doubling ends at the
        # second such window in a row, so one lucky baseline window of a few short answers
        # does not end it early.
        self._rose = False
        self.last: float | None = None
        self._slow_start = True
        # When the limit last changed: only answers to requests sent since judge it (the
        # answers still coming back were sent under the old limit).
        self._since = -math.inf
        self._latency = 0.0
        self._tokens = 0
        self._answers = 0
        self._saturated = 0
        self.how = f"measuring: starting at {start} (the server states no capacity)"

    def on_answer(self, latency_s: float, output_tokens: int, saturated: bool,
                  sent_at: float = math.inf) -> int | None:
        """One answer to a request sent at `sent_at` (the clock `now` is read on); returns the
        new limit when its window closes, else None."""
        if sent_at < self._since:
            return None
        self._latency += latency_s
        self._tokens += max(1, output_tokens)
        self._answers += 1
        self._saturated += saturated
        # While doubling, a few answers judge each step (the first answers after a step are
        # the shortest, and a server far below its capacity gives each token the same time
        # whatever their length); then about half the limit, to cover answers of every length.
        need = WINDOW_MIN if self._slow_start else min(WINDOW_MAX, max(WINDOW_MIN, self.limit // 2))
        if self._answers < need:
            return None
        per_token = self._latency / self._tokens
        busy = self._saturated * 2 >= self._answers
        self._latency, self._tokens, self._answers, self._saturated = 0.0, 0, 0, 0
        before = self.limit
        limit = self._judge(per_token, busy)
        if limit != before:
            self._since = self._now()
        return limit

    def _judge(self, per_token: float, busy: bool) -> int:
        self.last = per_token
        self.best = per_token if self.best is None else min(self.best, per_token)
        ratio = per_token / self.best
        if ratio > TOLERANCE:
            self._slow_start = False
            self.limit = max(1, int(self.limit * max(0.5, TOLERANCE / ratio)))
        elif busy and self._slow_start and (ratio < FLAT or not self._rose):
            self._rose = ratio >= FLAT
            self.limit = min(MAX_LIMIT, self.limit * 2)
        elif busy:
            self._slow_start = False
            self.limit = min(MAX_LIMIT, self.limit + max(1, int(math.sqrt(self.limit))))
        self.how = (f"adaptive: {1000 * per_token:.1f} ms per output token, best "
                    f"{1000 * self.best:.1f}; limit {self.limit}")
        return self.limit

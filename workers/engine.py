"""One asyncio loop, one httpx client and one concurrency limit per worker process.

Celery runs batches in pool threads; each hands its coroutine to this loop. All batches of
the process share one limiter sized from what the server really runs at once (plus a small
margin), so when one batch's tail drains, the next batch's prompts take the free slots: the
server stays full across batch boundaries. Where that figure comes from depends on the server's
kind (fleetgen/servers): SGLang states it, vLLM's queue gauges reveal it, for any other server
a one-token probe is timed (workers/limits.py); `FLEETGEN_MAX_IN_FLIGHT` overrides all three,
and a server refusing requests for being full caps them (workers/flow.py).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import logging
import math
import os
import socket
import threading
import time
from collections.abc import AsyncIterator, Coroutine, Sequence
from typing import Any, TypeVar

from tenacity import AsyncRetrying, RetryError, retry_if_result, stop_before_delay

from fleetgen import keys
from fleetgen.advertise import advertised_url
from fleetgen.errors import (
    BadRequestError,
    FleetgenError,
    GenerationError,
    OverloadedError,
    ServerDownError,
)
from fleetgen.fleet import REGISTRY_BEAT_S, ServerHealth, WorkerEntry, WorkerError
from fleetgen.liveledger import LiveLedger
from fleetgen.readings import parse_metrics, read_server_within
from fleetgen.redact import redact
from fleetgen.retry import REDIS_ERRORS, backoff
from fleetgen.servers import CONFIGURED, RequestBody, Server, ServerCapacity, stated_capacity
from fleetgen.settings import Settings
from workers import loops, metrics
from workers.client import ServerClient
from workers.flow import ServerWatch
from workers.limits import PROBE_START, QueueProbe, QueueWatch

log = logging.getLogger(__name__)
T = TypeVar("T")
HEALTH_PROBE_S = 1.0
# Waiting for a server to come back: /health probes under the one backoff policy.
READY_BACKOFF_S, READY_BACKOFF_MAX_S = 0.5, 5.0
# How often a server's queue gauges are read, or a probe sent, while its capacity is found
# from them.
LOAD_TICK_S = 1.0
# The one-token request that times a server's queue and tells a server out of rotation alive.
PROBE_BODY: RequestBody = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
# A server that has not answered the first probe by then is used without what it would have
# taught (the model it is pinned to is then learned from the first prompt's refusal).
FIRST_PROBE_S = 10.0
# Requests that found the server back at once refresh what is known of it once.
REFRESH_AGAIN_S = 1.0
# The answer rate a probe's wait is multiplied by is measured over this window.
ANSWER_RATE_S = 10.0
# The worker logs a change of its in-flight limit at most this often (the newest is kept).
LIMIT_LOG_EVERY_S = 10.0
# Where limit changes are told: INFO, whatever the worker's log level (like the ready line).
limits_log = logging.getLogger("workers.limits")
limits_log.setLevel(logging.INFO)
HOST = socket.gethostname()


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


class Backlog:
    """What this worker holds: batches in hand, batches still loading, prompts not yet sent,
    and how many prompts it has sent so far (their rate sizes the reserve; gate.py).

    The consumer gate reads it to take the next batch *before* the server would go idle,
    and not earlier, so no worker hoards prompts another GPU could be running.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.batches = 0
        self.loading = 0
        self.unsent = 0
        self.sent = 0

    def add(self, *, batches: int = 0, loading: int = 0, unsent: int = 0, sent: int = 0) -> None:
        with self._lock:
            self.batches += batches
            self.loading += loading
            self.unsent += unsent
            self.sent += sent


class Engine:
    """The worker process's asyncio side. `run(coro)` is called from Celery pool threads."""

    def __init__(self, settings: Settings, server_url: str, worker: str,
                 queues: Sequence[str] = ()) -> None:
        self.settings = settings
        self.server_url = server_url
        self.worker = worker
        # Published in the registry: `producer status` tells a job whose queue nobody consumes.
        self.queues = list(queues)
        # The last thing that kept a batch from running here, for `producer status`, or None.
        self.last_error: WorkerError | None = None
        self.capacity: ServerCapacity | None = None
        # The server as found at first contact (its kind, models, what it refused); None
        # until it answered once. Batches wait for it (`connected`).
        self.server: Server | None = None
        # Finds the limit of a server that does not state it; None when it does.
        self.control: QueueWatch | QueueProbe | None = None
        # What its requests met, whether it is in rotation, the overload ceiling (flow.py).
        self.watch = ServerWatch()
        # The limit the server's capacity calls for, before the overload ceiling.
        self._base_limit = 1
        self._answers: collections.deque[float] = collections.deque()
        # A probe's latency at an idle server (the probe controller's reference).
        self._idle_probe_s: float | None = None
        self._refreshed_at = -math.inf
        # When the limit was last logged, and what it was then.
        self._limit_logged = (-LIMIT_LOG_EVERY_S, 1)
        self.backlog = Backlog()
        self._loop = loops.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="fleetgen-loop", daemon=True)
        self._started = False
        self._lock = threading.Lock()
        self.client: ServerClient
        # The ledger's asyncio side, on this loop: the registry, leases, canary, breaker.
        self.live: LiveLedger
        self.limiter: Limiter
        self._refresher: concurrent.futures.Future[None] | None = None
        self._prober: concurrent.futures.Future[None] | None = None
        self._watcher: concurrent.futures.Future[None] | None = None
        self._rotator: concurrent.futures.Future[None] | None = None
        self._found: asyncio.Event
        # Consecutive failed /health probes; the consumer gate reads it (gate.py).
        self.health_failures = 0
        # Set at the start of a warm shutdown: batches send no new request and are handed back.
        self.draining = False
        # What the registry shows other nodes: server_url may be this node's loopback.
        self.advertised_url = advertised_url(server_url, settings)

    def start(self) -> None:
        with self._lock:
            if self._started:
                return
            self._thread.start()
            self._call(self._setup())
            self._started = True
            log.info("worker %s: serving %s (published as %s)", self.worker, self.server_url,
                     self.advertised_url)

    def stop(self) -> None:
        """Close the client and the loop; running batches have been cancelled by then."""
        with self._lock:
            if not self._started:
                return
            self._started = False
            for task in (self._refresher, self._prober, self._watcher, self._rotator):
                if task is not None:
                    task.cancel()
            try:
                self._call(self._teardown(), timeout=10)
            finally:
                self._loop.call_soon_threadsafe(self._loop.stop)
                self._thread.join(timeout=10)

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        if not self._started:
            self.start()
        return self._call(coro)

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def _call(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    async def _setup(self) -> None:
        self.client = ServerClient(
            self.server_url,
            request_timeout_s=self.settings.request_timeout_s,
            connect_timeout_s=self.settings.connect_timeout_s,
            api_key=self.settings.server_api_key,
        )
        self.live = LiveLedger.connect(self.settings, keys.worker_client(self.worker))
        # Start at 1 in flight until the server says what it can take.
        self.limiter = Limiter(1)
        self._found = asyncio.Event()
        self._refresher = asyncio.run_coroutine_threadsafe(self._refresh_forever(), self._loop)
        self._prober = asyncio.run_coroutine_threadsafe(self._probe_forever(), self._loop)
        self._watcher = asyncio.run_coroutine_threadsafe(self._watch_load_forever(), self._loop)
        self._rotator = asyncio.run_coroutine_threadsafe(self._rotate_forever(), self._loop)

    async def _teardown(self) -> None:
        await self.client.aclose()
        await self.live.aclose()

    def limit_for(self, capacity: ServerCapacity) -> int:
        if capacity.configured:
            return capacity.effective  # the operator's number (or 1): no margin on a guess
        return capacity.effective + self.margin(capacity.effective)

    def margin(self, capacity: int) -> int:
        """Requests kept waiting at the server beyond what it runs, so no slot idles while
        the next request travels."""
        return max(self.settings.queue_margin, int(capacity * self.settings.queue_margin_ratio))

    async def connected(self, deadline_s: float) -> Server:
        """The server once it has been found (ServerDownError past the deadline)."""
        if not self._found.is_set():
            try:
                await asyncio.wait_for(self._found.wait(), deadline_s)
            except TimeoutError:
                raise ServerDownError(f"{self.server_url}: not reachable to find what it is "
                                      f"after {deadline_s:.0f}s") from None
        assert self.server is not None
        return self.server

    async def refresh_capacity(self) -> ServerCapacity:
        """Find what the server is and how many requests to keep in flight there."""
        found = await self.client.detect()
        first = self.server is None
        server = self._adopt(found)
        probing = (self.control is None and not self.settings.max_in_flight
                   and not server.kind.reads_load
                   and (server.info is None or stated_capacity(server.info) is None))
        if (first and server.model is None and not server.kind.any_model) or probing:
            # Learn the served model from the server's own refusal of a probe, before any
            # prompt is sent (a server pinned to one model that /v1/models does not list);
            # and time an idle server, the probe controller's reference.
            with contextlib.suppress(GenerationError, TimeoutError):
                idle = self.limiter.active == 0
                latency = await asyncio.wait_for(self.probe(), FIRST_PROBE_S)
                if idle:
                    self._idle_probe_s = latency
        capacity = self._capacity(server)
        if self.control is not None:  # measured: the controller moves the limit, not this
            self._controlled(self.control.limit)
        else:
            if self.capacity is None or (capacity.effective, capacity.source) != (
                    self.capacity.effective, self.capacity.source):
                log.log(logging.WARNING if capacity.configured and not self.settings.max_in_flight
                        else logging.INFO,
                        "worker %s: %s is %s; %s; keeping %d in flight", self.worker,
                        self.server_url, server.describe(), capacity.source,
                        self.limit_for(capacity))
            self.capacity = capacity
            self._apply_limit(self.limit_for(capacity))
        if first:
            self._found.set()
            await self._register()  # `status` says what the server is from now on
        return capacity

    def _adopt(self, found: Server) -> Server:
        """The server found now; what an earlier contact learned is kept while it is the same
        kind serving the same models."""
        known = self.server
        if known is not None and (known.kind, known.models) == (found.kind, found.models):
            found.refused, found.pinned = known.refused, known.pinned
            found.__post_init__()
        elif known is not None:
            log.warning("worker %s: %s changed: now %s (was %s)", self.worker, self.server_url,
                        found.describe(), known.describe())
            self.control = None
        self.server = found
        return found

    def _capacity(self, server: Server) -> ServerCapacity:
        if self.settings.max_in_flight:
            n = self.settings.max_in_flight
            return ServerCapacity(n, None, f"{CONFIGURED}={n}", configured=True)
        stated = stated_capacity(server.info) if server.info is not None else None
        if stated is not None:
            self.control = None
            return stated
        if self.control is None:
            self.control = (QueueWatch(self.margin) if server.kind.reads_load
                            else QueueProbe(self.margin, idle_s=self._idle_probe_s))
            log.info("worker %s: %s (%s) does not state how many requests it runs at once; "
                     "finding it %s", self.worker, self.server_url, server.describe(),
                     "from its queue gauges" if isinstance(self.control, QueueWatch)
                     else "by timing a one-token probe a second")
        control = self.control
        return ServerCapacity(control.limit, None, control.how, configured=False)

    def _controlled(self, limit: int) -> None:
        """A controller moved the limit: apply it and publish how it was found."""
        control = self.control
        if control is None:
            return
        self.capacity = ServerCapacity(control.capacity or limit, None, control.how,
                                       configured=False)
        self._apply_limit(limit)

    def _apply_limit(self, base: int) -> None:
        """The limiter's size: what the server's capacity calls for (`base`), under the overload
        ceiling while one holds; a change is logged at most every LIMIT_LOG_EVERY_S."""
        self._base_limit = max(1, base)
        ceiling = self.watch.ceiling.value
        limit = self._base_limit if ceiling is None else min(self._base_limit, ceiling)
        before = self.limiter.limit
        self.limiter.limit = max(1, limit)
        self.limiter.resize()
        capacity = self.capacity.effective if self.capacity else limit
        metrics.set_server_capacity(self.worker, self.server_url, capacity, self.limiter.limit)
        if self.limiter.limit != before:
            self._log_limit()

    def _log_limit(self) -> None:
        """Log the limit if it changed since it was last logged, at most every
        LIMIT_LOG_EVERY_S (the registry beat calls again, so the newest is logged)."""
        now = time.monotonic()
        last_at, last_limit = self._limit_logged
        if now - last_at >= LIMIT_LOG_EVERY_S and self.limiter.limit != last_limit:
            self._limit_logged = (now, self.limiter.limit)
            limits_log.info("worker %s: in flight up to %d (was %d): %s", self.worker,
                            self.limiter.limit, last_limit, self.limit_reason)

    @property
    def limit_reason(self) -> str:
        """Why the limit is what it is, in a few words (`status`, the log)."""
        ceiling = self.watch.ceiling.value
        if ceiling is not None and ceiling < self._base_limit and self.watch.ceiling_reason:
            return self.watch.ceiling_reason
        return self.capacity.source if self.capacity else "not found yet"

    @property
    def in_rotation(self) -> bool:
        return self.watch.rotation.in_rotation

    def answered(self) -> None:
        """A request was answered (any 200)."""
        now = time.monotonic()
        answers = self._answers
        answers.append(now)
        while answers and now - answers[0] > ANSWER_RATE_S:
            answers.popleft()
        if self.watch.answered(self._base_limit):
            self._apply_limit(self._base_limit)

    def answer_rate(self) -> float:
        """Answers per second over the last ANSWER_RATE_S."""
        now = time.monotonic()
        while self._answers and now - self._answers[0] > ANSWER_RATE_S:
            self._answers.popleft()
        return len(self._answers) / ANSWER_RATE_S

    def overloaded(self, exc: OverloadedError, refusals: int) -> float:
        """A request refused for a full server: cut the ceiling, count it; the seconds it waits
        before it is sent again."""
        if self.watch.overloaded(exc, self.limiter.active, self._base_limit) is not None:
            self._apply_limit(self._base_limit)
        metrics.request_refused(self.worker, self.server_url, "overloaded", exc.status)
        return self.watch.overload_wait_s(exc, refusals)

    def refused(self, exc: BadRequestError) -> None:
        """A request the server refused (4xx): the server works."""
        self.watch.refused(exc)
        metrics.request_refused(self.worker, self.server_url, "refused", exc.status)

    def request_failed(self, exc: GenerationError) -> bool:
        """A server-caused failure; True when the server is (now) out of rotation."""
        # The failed request gave its slot back: what holds one is running.
        ejected = self.watch.failed(exc, self.limiter.active)
        metrics.request_refused(self.worker, self.server_url, "failed", exc.status)
        if ejected:
            self._ejected()
        return not self.in_rotation

    def eject(self, reason: str) -> None:
        """Take the server out of rotation (a prompt's tries all failed and a probe failed)."""
        if self.in_rotation:
            self.watch.rotation.eject(reason)
            self._ejected()

    def _ejected(self) -> None:
        rotation = self.watch.rotation
        log.warning("worker %s: %s taken out of rotation: %s; its batches go back to the queue "
                    "and it is probed until it answers", self.worker, self.server_url,
                    rotation.reason)
        metrics.set_in_rotation(self.worker, self.server_url, False)
        self.submit(self._register())

    async def probe(self) -> float:
        """One one-token request to the server; its latency. A refusal that teaches the worker
        something (the model it is pinned to, a field it refuses) is learned and the probe
        sent again; other errors are raised (GenerationError)."""
        server = self.server
        assert server is not None
        while True:
            stored = PROBE_BODY.copy()
            if server.model is None and server.models:
                stored["model"] = server.models[0]
            body = server.prepare(stored, thinking=False)
            start = time.monotonic()
            try:
                await self.client.chat(body)
            except BadRequestError as exc:
                learned = server.learn(exc.status, exc.message, body, stored)
                if learned is None:
                    raise
                log.warning("worker %s: %s %s (it answered %s)", self.worker, self.server_url,
                            learned, exc.message[:200])
                continue
            return time.monotonic() - start

    async def _rotate_forever(self) -> None:
        """While the server is out of rotation, probe it on a growing backoff; an answer (or a
        refusal: the server runs requests) puts it back."""
        rotation = self.watch.rotation
        while True:
            if rotation.in_rotation:
                rotation.changed.clear()
                await rotation.changed.wait()
                continue
            await asyncio.sleep(rotation.next_probe_s())
            if self.server is None:
                continue
            try:
                await self.probe()
            except (BadRequestError, OverloadedError):
                pass  # refused or full, but running requests: fit to take work
            except GenerationError as exc:
                log.info("worker %s: %s still out of rotation (probe %d: %s)", self.worker,
                         self.server_url, rotation.probes, exc)
                continue
            out_s = time.time() - (rotation.out_since or time.time())
            rotation.rejoin()
            log.warning("worker %s: %s answered a probe; back in rotation after %.0fs",
                        self.worker, self.server_url, out_s)
            metrics.set_in_rotation(self.worker, self.server_url, True)
            await self._register()

    async def _watch_load_forever(self) -> None:
        """Find the capacity of a server that does not state it: read its queue gauges, or
        time a probe, once a tick while requests are in flight."""
        while True:
            await asyncio.sleep(LOAD_TICK_S)
            control, server = self.control, self.server
            if server is None or control is None or not self.in_rotation:
                continue
            if isinstance(control, QueueWatch):
                await self._read_load(control)
            elif self.limiter.active > 0:
                await self._probe_load(control)

    async def _probe_load(self, control: QueueProbe) -> None:
        in_flight = self.limiter.active
        try:
            latency = await self.probe()
        except GenerationError as exc:
            log.debug("worker %s: probe unanswered (%s)", self.worker, exc)
            return
        saturated = self.limiter.waited or self.limiter.waiting > 0
        self.limiter.waited = False
        before = control.capacity
        limit = control.on_probe(latency, in_flight, saturated, self.answer_rate())
        if control.capacity != before:
            log.info("worker %s: %s", self.worker, control.how)
        self._controlled(limit)

    async def _read_load(self, control: QueueWatch) -> None:
        try:
            response = await self.client.http.get("/metrics", timeout=LOAD_TICK_S * 5)
            gauges = parse_metrics(response.text) if response.status_code == 200 else {}
        except Exception as exc:  # noqa: BLE001 - a missed tick; the next one reads again
            log.debug("worker %s: /metrics unread (%r)", self.worker, exc)
            return
        if "running" not in gauges or "queue" not in gauges:
            return
        saturated = self.limiter.waited or self.limiter.active >= self.limiter.limit
        self.limiter.waited = False
        before = control.capacity, control.limit
        limit = control.on_load(gauges["running"], gauges["queue"], saturated)
        if control.capacity != before[0] or (control.capacity is None and limit != before[1]):
            log.info("worker %s: %s", self.worker, control.how)
        self._controlled(limit)

    async def _refresh_forever(self) -> None:
        while True:
            try:
                await self.refresh_capacity()
                delay = self.settings.capacity_refresh_s
            except FleetgenError as exc:
                log.info("worker %s: capacity not readable yet (%s)", self.worker, exc)
                delay = 1.0
            except Exception:  # a surprise must not end the loop batches wait on
                log.exception("worker %s: reading %s failed", self.worker, self.server_url)
                delay = self.settings.capacity_refresh_s
            await asyncio.sleep(delay)

    async def _probe_forever(self) -> None:
        beat = 0.0
        while True:
            if await self.client.ready():
                if self.health_failures:
                    self._restarted()
                    await self._refresh_quietly()
                self.health_failures = 0
            else:
                self.health_failures += 1
            if time.monotonic() - beat >= REGISTRY_BEAT_S:
                beat = time.monotonic()
                self._log_limit()
                await self._register()
            await asyncio.sleep(HEALTH_PROBE_S)

    def _restarted(self) -> None:
        """The server is back after failing its health probes: it may have restarted with
        other endpoints or another capacity, so both are found again."""
        self.client.forget()
        self.watch.ceiling.value = None
        if isinstance(self.control, QueueProbe):
            # Measured again from the start: the requests waiting for the server go back at
            # the ramp's first limit, not at the old server's (the idle probe's time is kept).
            self.control = None
            self._apply_limit(PROBE_START)

    async def _register(self) -> None:
        """Tell `producer status` who this worker is, what it serves, and how busy it is."""
        capacity = self.capacity
        # What the server says, for `status` where the server cannot be read live.
        reading = await read_server_within(self.client.http, self.server_url,
                                           self.client.api_key, REGISTRY_BEAT_S / 2)
        entry = WorkerEntry(
            worker=self.worker,
            host=HOST,
            pid=os.getpid(),
            queues=self.queues,
            last_error=self.last_error,
            server=self.advertised_url,
            local_server=self.server_url,
            reading=reading,
            state=("server-down" if self.health_failures
                   else "ready" if self.in_rotation else "out-of-rotation"),
            server_kind=self.server.describe() if self.server else None,
            effective_max_running_requests=capacity.effective if capacity else None,
            requested_max_running_requests=capacity.requested if capacity else None,
            capacity_source=capacity.source if capacity else None,
            limit=self.limiter.limit,
            in_flight=self.limiter.active,
            updated=time.time(),
            health=self.health(),
        )
        try:
            await self.live.publish_worker(self.worker, entry.to_json())
        except REDIS_ERRORS as exc:
            log.info("worker %s: registry update skipped (%s)", self.worker, exc)

    def health(self) -> ServerHealth:
        """How the server treated this worker's requests lately (`status`, Flower, metrics)."""
        return self.watch.health(self.limiter.limit, self.limit_reason)

    def note_error(self, job: str, error: str) -> None:
        """Remember why a batch of `job` could not run here and publish it now (the registry
        beat keeps it there)."""
        # Registry entries are readable by every Redis user: no URL credential in them.
        self.last_error = WorkerError(error=redact(error), job=job, at=time.time())
        if self._started:
            self.submit(self._register())

    def publish(self) -> None:
        """Register now rather than at the next beat (the worker has just started)."""
        if self._started:
            self.submit(self._register())

    async def _refresh_quietly(self) -> None:
        """Find the server again, once however many requests were waiting for it."""
        now = time.monotonic()
        if now - self._refreshed_at < REFRESH_AGAIN_S:
            return
        self._refreshed_at = now
        try:
            await self.refresh_capacity()
        except FleetgenError as exc:
            log.info("worker %s: capacity not readable yet (%s)", self.worker, exc)

    def server_failed(self) -> None:
        """A request found the server gone: count it as a failed probe at once, so the gate
        takes no new batch before the next /health probe confirms."""
        self.health_failures = max(1, self.health_failures)

    async def wait_ready(self, deadline_s: float) -> None:
        """Wait until the server answers /health again; raise ServerDownError past the deadline."""
        probes = AsyncRetrying(retry=retry_if_result(lambda ready: not ready),
                               stop=stop_before_delay(deadline_s),
                               wait=backoff(READY_BACKOFF_S, READY_BACKOFF_MAX_S))
        try:
            await probes(self.client.ready)
        except RetryError:
            raise ServerDownError(f"{self.server_url} not ready after {deadline_s:.0f}s") from None
        await self._refresh_quietly()

"""The worker's view of its server, as a load balancer's of a backend, and its one door.

`Backend.send(request)` is the only way a prompt's request reaches the server. Behind it: what
the server is (`discovery`), how many requests it takes at once (`in_flight`), whether it is fit
for work (`checks`: rotation, hangs), how loaded it is (`load`), what the registry says of it
(`registration`), the resend budget and what every reply counts for. What came back is read
once (fleetgen/causes.py `classify`, in workers/client.py) and `send` executes its cause:

    overloaded   wait (Retry-After, else the backoff), keeping the slot, and send again
    down         wait for /health (no attempt); out of rotation meanwhile: held
    refused      learn what fleetgen added and the server refuses, and send again; else raise
                 BadRequestError (the prompt's fault, or the job's: its `code` says)
    server       count it toward the server's record (a probe decides when many prompts fail)
                 and raise RetryableError: the caller's attempts decide
    held         RequestHeldError: not sent, or abandoned at a hung server or a warm shutdown's
                 end; handed back at no attempt

Built on the worker's loop (`Backend.open`, from workers/bridge.py's thread), where its
watchers run until `close`: the server found again every FLEETGEN_CAPACITY_REFRESH_S, its
`/health` probed every second, its progress watched, its load read while its capacity is
measured, a server out of rotation probed until it answers, the registry entry written every
beat.

    backend = loop.run(Backend.open(settings, url, worker, queues, loop, live))
    completion, latency_s = await backend.send(Request(body, job="j", name="p1", key="p1"))
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from fleetgen.causes import Reply, classify
from fleetgen.endpoints import CHAT, ENDPOINTS, Endpoint
from fleetgen.errors import (
    BadRequestError,
    OverloadedError,
    RequestHeldError,
    RetryableError,
    ServerDownError,
)
from fleetgen.liveledger import LiveLedger
from fleetgen.servers import ChatCompletion, RequestBody
from fleetgen.settings import Settings
from workers import metrics
from workers.backlog import Delivery
from workers.bridge import LoopThread
from workers.client import ServerClient
from workers.discovery import Discovery
from workers.flow import ServerWatch
from workers.healthcheck import HealthChecks
from workers.limits import InFlight
from workers.load import LoadWatch
from workers.registration import Registration

log = logging.getLogger(__name__)
# How long closing waits for the watchers to end once cancelled.
CLOSE_WAIT_S = 1.0
# A server whose /health answers within this of a lost connection was not down.
UP_AT_ONCE_S = 1.0


def _never_held() -> str | None:
    return None


@dataclass
class Request:
    """One request to send: a prompt's stored body (`n` answers of it), whose it is (`key`:
    failures are counted per prompt), what to call it in the log, whether it is a resend of a
    failed try, and why it must not go now (`hold`: the job paused, say), checked before it
    goes and again after each wait."""

    body: RequestBody
    job: str
    name: str
    key: str
    n: int = 1
    # What it asks (fleetgen/endpoints.py): where it goes, and how many sequences it puts on
    # the server (each text of an embeddings `input` is one).
    endpoint: Endpoint = ENDPOINTS[CHAT]
    thinking: bool = False
    resend: bool = False
    hold: Callable[[], str | None] = _never_held
    delivery: Delivery | None = None
    # Seconds it waited for a slot, over all of its sends.
    queue_wait_s: float = 0.0
    # When its first try began (monotonic): `Backend.settle` asks whether a request sent
    # since was answered.
    first_try_at: float | None = None

    @property
    def slots(self) -> int:
        """The server's slots it holds: one per answer, or per text of an embeddings request."""
        return self.n * self.endpoint.inputs(self.body)


class Backend:
    """The worker's server and what the worker knows of it; its parts are public."""

    def __init__(self, settings: Settings, server_url: str, worker: str, queues: Sequence[str],
                 loop: LoopThread, live: LiveLedger) -> None:
        self.server_url = server_url
        self.worker = worker
        self._client = ServerClient(
            server_url,
            request_timeout_s=settings.request_timeout_s,
            connect_timeout_s=settings.connect_timeout_s,
            api_key=settings.server_api_key,
        )
        self._settings = settings
        # What its requests met, whether it is in rotation, the overload ceiling (flow.py).
        self.watch = ServerWatch(settings.hang_after_s)
        self.in_flight = InFlight(settings, worker, server_url, self.watch)
        self.discovery = Discovery(settings, worker, server_url, self._client, self.in_flight,
                                   lambda: self.registration.publish())
        self.checks = HealthChecks(worker, server_url, self._client, self.watch, self.in_flight,
                                   self.discovery, lambda: self.registration.publish(),
                                   self._abandon, lambda: len(self._running))
        self.load = LoadWatch(worker, server_url, self._client, self.watch, self.in_flight,
                              self.discovery)
        self.registration = Registration(settings, worker, server_url, queues, loop, live,
                                         self.in_flight, self.discovery, self.checks, self.load)
        self._watchers: list[asyncio.Task[None]] = []
        # The tasks whose request is at the server now, and those told to give it up (a hung
        # server, a warm shutdown's end) with why.
        self._running: set[asyncio.Task[object]] = set()
        self._abandoned: dict[asyncio.Task[object], str] = {}
        # Set at the start of a warm shutdown (from a signal handler's thread).
        self._draining = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None

    @classmethod
    async def open(cls, settings: Settings, server_url: str, worker: str,
                   queues: Sequence[str], loop: LoopThread, live: LiveLedger) -> Backend:
        """The backend, its watchers started on the running loop (the worker's)."""
        backend = cls(settings, server_url, worker, queues, loop, live)
        backend._watchers = [asyncio.create_task(watcher) for watcher in (
            backend.discovery.refresh_forever(), backend.checks.probe_forever(),
            backend.load.watch_forever(), backend.checks.rotate_forever(),
            backend.checks.progress_forever(), backend.registration.beat_forever())]
        backend._loop = asyncio.get_running_loop()
        log.info("worker %s: serving %s (published as %s)", worker, server_url,
                 backend.registration.advertised_url)
        return backend

    async def close(self) -> None:
        """Stop the watchers and close the client; running batches have been cancelled."""
        self.registration.closed = True
        for watcher in self._watchers:
            watcher.cancel()
        if self._watchers:
            await asyncio.wait(self._watchers, timeout=CLOSE_WAIT_S)
        await self._client.aclose()

    # The door.

    async def takes_n(self) -> bool:
        """Whether a prompt's answers go as one request with `n`, once the server is found; a
        server not found within the down-wait is sent one request per answer (always right;
        each request then waits for the server on its own)."""
        with contextlib.suppress(ServerDownError):
            server = await self.discovery.connected(self._settings.server_down_wait_s)
            return server.takes_n
        return False

    async def send(self, request: Request) -> tuple[ChatCompletion, float]:
        """One try of `request`: its completion and latency, or why not (the module's table).

        Raises BadRequestError (refused: the prompt's fault or the job's, by its `code`),
        RetryableError (the server failed it: the caller's attempts decide), RequestHeldError
        (not sent, or abandoned: no attempt)."""
        watch = self.watch
        if request.resend:
            await watch.budget.resend()
        else:
            watch.budget.first_try()
            request.first_try_at = time.monotonic()
        checks, in_flight, delivery = self.checks, self.in_flight, request.delivery
        while True:
            try:
                server = await self.discovery.connected(self._settings.server_down_wait_s)
                if request.n > 1 and not server.takes_n:
                    raise RequestHeldError(RequestHeldError.SPLIT)
                body = server.prepare(request.body, thinking=request.thinking, n=request.n,
                                      chat=request.endpoint.name == CHAT)
                waited = time.monotonic()
                async with in_flight.slots(request.slots):
                    self._may_send(request)
                    if delivery is not None:
                        delivery.leaves()
                    request.queue_wait_s += time.monotonic() - waited
                    start, response = await self._exchange(request, body)
                latency = time.monotonic() - start
                for _ in range(request.slots):
                    in_flight.answered(start)
                self.discovery.probing = request.endpoint
                return response, latency
            except BadRequestError as exc:
                checks.refused(exc)
                learned = server.learn(exc.status, exc.message, body, request.body)
                if learned is not None:
                    log.warning("worker %s: %s %s (it answered %s)", self.worker,
                                self.server_url, learned, exc.message[:200])
                elif request.n > 1 and not server.takes_n:
                    raise RequestHeldError(RequestHeldError.SPLIT) from None
                elif not server.resend(body, request.body, thinking=request.thinking,
                                       chat=request.endpoint.name == CHAT):
                    raise
            except RetryableError as exc:
                if await self._failed(exc, request):
                    raise RequestHeldError(RequestHeldError.OUT,
                                           self.watch.rotation.reason) from None
                raise
            except ServerDownError as exc:
                waited = time.monotonic()
                await self._wait_down(request)
                if exc.status is None and time.monotonic() - waited < UP_AT_ONCE_S:
                    # /health answered at once: the server is up and dropped this request (a
                    # reset): its failure, counted and resent within the budget like a 5xx.
                    if await self._failed(exc, request):
                        raise RequestHeldError(RequestHeldError.OUT,
                                               self.watch.rotation.reason) from None
                    await watch.budget.resend()

    async def settle(self, exc: RetryableError, request: Request, tries: int) -> bool:
        """Whether `request`, whose every try failed for a server-side reason, failed for its
        own: the server answered other requests since its first try, or answers a probe now.
        If not, the server is out of rotation."""
        first_try_at = request.first_try_at
        return await self.checks.settle(
            exc, float("-inf") if first_try_at is None else first_try_at, tries)

    def drain(self, grace_s: float) -> None:
        """A warm shutdown began: nothing more is sent (held, handed back), and what is still at
        the server after `grace_s` is abandoned and handed back too, whatever the server does.
        Called from a signal handler: it only sets a flag and schedules the timer."""
        self._draining.set()
        loop = self._loop
        if loop is not None:
            loop.call_soon_threadsafe(loop.call_later, grace_s, self._abandon,
                                      RequestHeldError.STOPPING)

    def _may_send(self, request: Request) -> None:
        """Raise RequestHeldError when the request must not be sent now, with why."""
        if self._draining.is_set():
            raise RequestHeldError(RequestHeldError.STOPPING)
        why = request.hold()
        if why is not None:
            raise RequestHeldError(why)
        if not self.checks.in_rotation:
            raise RequestHeldError(RequestHeldError.OUT, self.watch.rotation.reason)

    async def _exchange(self, request: Request,
                        body: RequestBody) -> tuple[float, ChatCompletion]:
        """The request and its answer, holding its slots: when and what it was answered. A
        refusal for a full server is waited out here (the one place an overload is caught), the
        slots kept, so that it frees none for the next request to be refused in turn; the wait
        is the server's Retry-After or the backoff, and draws on no budget. A refusal while
        /health fails too is a server down (ServerDownError)."""
        refusals = 0
        task = asyncio.current_task()
        assert task is not None
        progress = self.watch.progress
        job, worker, server = request.job, self.worker, self.server_url
        while True:
            start = time.monotonic()
            metrics.request_started(job, worker, server)
            progress.sending(len(self._running))
            self._running.add(task)
            replied = True
            try:
                return start, await self._client.post(request.endpoint, body)
            except OverloadedError as exc:
                if self.checks.failures:
                    # Refused while /health fails too: starting or draining, not full.
                    raise ServerDownError(exc.message, status=exc.status,
                                          code="server_down") from exc
                refusals += 1
                wait_s = self.in_flight.overloaded(exc, refusals)
                log.debug("prompt %s: %s; sending again in %.1fs", request.name, exc.message,
                          wait_s)
            except asyncio.CancelledError:
                replied = False
                why = self._abandoned.pop(task, None)
                if why is None:
                    raise
                task.uncancel()
                if why != RequestHeldError.OUT:
                    raise RequestHeldError(why) from None
                # A hung server: the table's verdict, not there (handed back, no attempt).
                verdict = classify(Reply(failure="hung", detail=self.watch.rotation.reason or ""))
                raise RequestHeldError(why, verdict.message) from None
            finally:
                self._running.discard(task)
                if replied:
                    progress.replied(len(self._running))
                metrics.request_ended(job, worker, server)
            await asyncio.sleep(wait_s)
            self._may_send(request)
            # Over a ceiling cut meanwhile: wait in line for a slot again, so that no more
            # refused requests go back at once than the ceiling lets in.
            await self.in_flight.requeue(request.slots)

    def _abandon(self, why: str) -> None:
        """Give up every request at the server now (hung, or a warm shutdown's grace over):
        each is handed back unanswered, at no attempt."""
        for task in list(self._running):
            if task not in self._abandoned:
                self._abandoned[task] = why
                task.cancel()
                metrics.request_refused(self.worker, self.server_url, "abandoned", None)

    async def _failed(self, exc: RetryableError | ServerDownError, request: Request) -> bool:
        """Count a server-caused failure of `request`; True when the server is out of rotation
        (now, or a probe the failures called for was not answered)."""
        return await self.checks.request_failed(exc, request.key)

    async def _wait_down(self, request: Request) -> None:
        """The server is gone: wait for /health, spending nothing; a server out of rotation
        meanwhile (restarting, failing) hands the request back instead."""
        delivery = request.delivery
        self.checks.server_failed()
        if delivery is not None:
            delivery.server_lost()
        self._may_send(request)
        await self.checks.wait_ready(self._settings.server_down_wait_s)
        self._may_send(request)

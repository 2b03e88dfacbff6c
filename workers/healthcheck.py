"""Whether the worker's server is fit to take work, as a load balancer checks a backend.

Three checks. Its `/health`, once a second: a server failing it takes no new batch (gate.py)
and, once it answers again, may have restarted as something else, so it is found again. What
its requests meet (workers/flow.py `ServerWatch`): when requests of many prompts fail, a probe
decides whether the server fails what it is sent; if so it is taken out of rotation (ejected),
its batches go back to the queue, and it is probed on a growing backoff until it answers; then
it rejoins. And its progress: requests in flight with nothing back for many times the usual gap
between replies, and a probe unanswered too, is a hung server: out of rotation, its requests
abandoned and handed back (workers/backend.py).

Every probe has its own timeout (PROBE_TIMEOUT_S): a probe that hangs is an answer too.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from tenacity import AsyncRetrying, RetryError, retry_if_result, stop_before_delay

from fleetgen.errors import (
    BadRequestError,
    GenerationError,
    OverloadedError,
    RequestHeldError,
    ServerDownError,
)
from fleetgen.fleet import ServerHealth
from fleetgen.retry import backoff
from workers import metrics
from workers.client import ServerClient
from workers.discovery import Discovery
from workers.flow import PROBE_TIMEOUT_S, ServerWatch
from workers.limits import InFlight

log = logging.getLogger(__name__)
HEALTH_PROBE_S = 1.0
# While a restart is announced, /health is probed this often: a server down for less than a
# probe's interval would not be seen restarting.
RESTART_PROBE_S = 0.2
# Waiting for a server to come back: /health probes under the one backoff policy.
READY_BACKOFF_S, READY_BACKOFF_MAX_S = 0.5, 5.0
# A server announced as restarting and not seen restarting within this long is probed as any
# server out of rotation (a probe answered puts it back).
RESTART_WAIT_S = 600.0
# How often the progress of requests in flight is looked at.
PROGRESS_TICK_S = 1.0
# Probes that must all go unanswered before failures of many prompts take a server out: one
# answered says the server works (a flaky proxy, poison prompts).
CONFIRM_PROBES = 2


class HealthChecks:
    """The server's `/health` probes and its rotation (out on failures, back on a probe)."""

    def __init__(self, worker: str, server_url: str, client: ServerClient, watch: ServerWatch,
                 in_flight: InFlight, discovery: Discovery, publish: Callable[[], None],
                 abandon: Callable[[str], None], at_server: Callable[[], int]) -> None:
        self._worker = worker
        self._server_url = server_url
        self._client = client
        self._watch = watch
        self._in_flight = in_flight
        self._discovery = discovery
        # Tells the registry at once when the server leaves or rejoins the rotation.
        self._publish = publish
        # Gives up the requests at the server (a hung one), and counts them (not those waiting
        # out a full server's Retry-After): workers/backend.py.
        self._abandon = abandon
        self._at_server = at_server
        # Consecutive failed /health probes; the consumer gate reads it (gate.py).
        self.failures = 0
        # The probe a run of failures called for, shared by every request that failed meanwhile.
        self._check: asyncio.Future[bool] | None = None

    @property
    def in_rotation(self) -> bool:
        return self._watch.rotation.in_rotation

    async def probe_forever(self) -> None:
        while True:
            if await self._client.ready():
                if self.failures:
                    self._restarted()
                    await self._discovery.refresh_soon()
                    if self._watch.rotation.awaiting_restart:
                        self._rejoin("is back from its restart")
                self.failures = 0
            else:
                self.failures += 1
            await asyncio.sleep(RESTART_PROBE_S if self._watch.rotation.awaiting_restart
                                else HEALTH_PROBE_S)

    def _restarted(self) -> None:
        """The server is back after failing its health probes: it may have restarted with
        other endpoints or another capacity, so both are found again."""
        self._client.forget()
        self._in_flight.forget(restarted=True)

    async def rotate_forever(self) -> None:
        """While the server is out of rotation, probe it on a growing backoff; an answer (or a
        refusal: the server runs requests) puts it back."""
        rotation = self._watch.rotation
        while True:
            if rotation.in_rotation:
                rotation.changed.clear()
                await rotation.changed.wait()
                continue
            if rotation.awaiting_restart:
                rotation.changed.clear()
                try:
                    await asyncio.wait_for(rotation.changed.wait(), RESTART_WAIT_S)
                except TimeoutError:
                    rotation.awaiting_restart = False  # never seen restarting: probe it
                continue
            await asyncio.sleep(rotation.next_probe_s())
            if self._discovery.server is None or rotation.awaiting_restart:
                continue  # a restart announced meanwhile: it is waited for, not probed
            failed = await self._probe()
            if failed is not None:
                log.info("worker %s: %s still out of rotation (probe %d: %s)", self._worker,
                         self._server_url, rotation.probes, failed)
                continue
            self._rejoin("answered a probe")

    async def _probe(self) -> str | None:
        """One time-boxed probe: None when the server answered it (or refused it, or said it is
        full: it runs requests), else what went wrong."""
        try:
            await self._discovery.probe(PROBE_TIMEOUT_S)
        except (BadRequestError, OverloadedError):
            return None
        except GenerationError as exc:
            return exc.message[:200]
        return None

    async def progress_forever(self) -> None:
        """Watch that requests in flight get replies: nothing back for many times the usual
        gap (flow.py `Progress`) calls for a probe; unanswered, the server is hung."""
        progress, rotation = self._watch.progress, self._watch.rotation
        while True:
            await asyncio.sleep(PROGRESS_TICK_S)
            active = self._at_server()
            quiet = progress.quiet_s(active)
            if (quiet is None or not rotation.in_rotation or self._discovery.server is None
                    or quiet < progress.stall_s()):
                continue
            failed = await self._probe()
            if failed is None:
                progress.heard()
                continue
            if not rotation.in_rotation:
                continue
            rotation.eject(f"hung: {active} requests in flight and nothing back for "
                           f"{quiet:.0f}s; a probe unanswered ({failed})")
            self._ejected()
            metrics.server_hung(self._worker, self._server_url)
            self._abandon(RequestHeldError.OUT)

    def _rejoin(self, why: str) -> None:
        rotation = self._watch.rotation
        out_s = time.time() - (rotation.out_since or time.time())
        rotation.rejoin()
        log.warning("worker %s: %s %s; back in rotation after %.0fs",
                    self._worker, self._server_url, why, out_s)
        metrics.set_in_rotation(self._worker, self._server_url, True)
        self._publish()

    def restarting(self) -> None:
        """Its supervisor is draining the server to restart it: out of rotation until it is
        seen back. Nothing more is sent; what was not sent goes back to the queue with its
        batch, what finishes within the drain is kept, and what the restart cuts goes back
        too, at no attempt (workers/batch.py)."""
        rotation = self._watch.rotation
        if rotation.in_rotation:
            rotation.eject("restarting: its supervisor drains it")
            self._ejected()
        rotation.awaiting_restart = True

    def refused(self, exc: BadRequestError) -> None:
        """A request the server refused (4xx): the server works."""
        self._watch.refused(exc)
        metrics.request_refused(self._worker, self._server_url, "refused", exc.status)

    async def request_failed(self, exc: GenerationError, prompt: str) -> bool:
        """A server-caused failure of `prompt`'s request; True when the server is (now) out of
        rotation. Failures of many prompts call for one probe, shared by every request failing
        meanwhile: unanswered, the server goes out; answered, the failures were the prompts'."""
        # The failed request gave its slot back: what holds one is running.
        suspect = self._watch.failed(exc, self._in_flight.active, prompt)
        metrics.request_refused(self._worker, self._server_url, "failed", exc.status)
        if self._check is not None:
            return await asyncio.shield(self._check)
        if not suspect:
            return not self.in_rotation
        self._check = asyncio.get_running_loop().create_future()
        try:
            out = await self._confirm()
        finally:
            check, self._check = self._check, None
            if not check.done():
                check.set_result(not self.in_rotation)
        return out

    async def _confirm(self) -> bool:
        """Probe a suspect server: out of rotation if none of CONFIRM_PROBES probes is
        answered (True). A server failing everything fails them at once; a poison prompt's
        server answers the first."""
        rotation = self._watch.rotation
        for _ in range(CONFIRM_PROBES):
            failed = await self._probe()
            if failed is None or not rotation.in_rotation:
                break
        if not rotation.in_rotation:
            return True
        if failed is None:
            log.info("worker %s: %s answered a probe while %s: the prompts' own failures, not "
                     "the server's", self._worker, self._server_url, rotation.suspicion)
            rotation.cleared()
            self._watch.budget.refill()
            return False
        self.eject(f"{rotation.suspicion}; a probe failed too ({failed})")
        return True

    async def settle(self, exc: GenerationError, first_try_at: float, tries: int) -> bool:
        """Whether a prompt whose every try failed for a server-side reason failed for its own:
        the server answered a request sent after its first try (at `first_try_at`, monotonic),
        or answers a probe now. If not, the server is taken out of rotation. An answer to a
        request sent before that try does not count: at an outage's onset the answers of
        requests already running still come back while every new one fails."""
        if not self.in_rotation:
            return False
        if self._watch.rotation.newest_answered_sent > first_try_at:
            return True
        failed = await self._probe()
        if failed is None:
            return True
        self.eject(f"a prompt's {tries} tries failed ({exc.message[:120]}) and so did a "
                   f"probe ({failed})")
        return False

    def eject(self, reason: str) -> None:
        """Take the server out of rotation."""
        if self.in_rotation:
            self._watch.rotation.eject(reason)
            self._ejected()

    def _ejected(self) -> None:
        log.warning("worker %s: %s taken out of rotation: %s; its batches go back to the queue "
                    "and it is probed until it answers", self._worker, self._server_url,
                    self._watch.rotation.reason)
        metrics.set_in_rotation(self._worker, self._server_url, False)
        self._publish()

    def server_failed(self) -> None:
        """A request found the server gone: count it as a failed probe at once, so the gate
        takes no new batch before the next /health probe confirms."""
        self.failures = max(1, self.failures)

    async def wait_ready(self, deadline_s: float) -> None:
        """Wait until the server answers /health again; raise ServerDownError past the deadline."""
        # A server announced as restarting is not waited for: its work goes elsewhere.
        probes = AsyncRetrying(retry=retry_if_result(
                                   lambda ready: not ready
                                   and not self._watch.rotation.awaiting_restart),
                               stop=stop_before_delay(deadline_s),
                               wait=backoff(READY_BACKOFF_S, READY_BACKOFF_MAX_S))
        try:
            await probes(self._client.ready)
        except RetryError:
            if not self._watch.rotation.awaiting_restart:
                raise ServerDownError(
                    f"{self._server_url} not ready after {deadline_s:.0f}s") from None
        if self._watch.rotation.awaiting_restart:
            return  # the caller sees the server out of rotation and hands back
        await self._discovery.refresh_soon()

    def report(self) -> ServerHealth:
        """How the server treated this worker's requests lately (`status`, Flower, metrics)."""
        return self._watch.health(self._in_flight.limit, self._in_flight.reason)

"""Whether the worker's server is fit to take work, as a load balancer checks a backend.

Two checks. Its `/health`, once a second: a server failing it takes no new batch (gate.py)
and, once it answers again, may have restarted as something else, so it is found again. And
what its requests meet (workers/flow.py `ServerWatch`): a server failing what it is sent is
taken out of rotation (ejected), its batches go back to the queue, and it is probed on a
growing backoff until it answers; then it rejoins.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from tenacity import AsyncRetrying, RetryError, retry_if_result, stop_before_delay

from fleetgen.errors import BadRequestError, GenerationError, OverloadedError, ServerDownError
from fleetgen.fleet import ServerHealth
from fleetgen.retry import backoff
from workers import metrics
from workers.client import ServerClient
from workers.discovery import Discovery
from workers.flow import ServerWatch
from workers.limits import InFlight

log = logging.getLogger(__name__)
HEALTH_PROBE_S = 1.0
# Waiting for a server to come back: /health probes under the one backoff policy.
READY_BACKOFF_S, READY_BACKOFF_MAX_S = 0.5, 5.0


class HealthChecks:
    """The server's `/health` probes and its rotation (out on failures, back on a probe)."""

    def __init__(self, worker: str, server_url: str, client: ServerClient, watch: ServerWatch,
                 in_flight: InFlight, discovery: Discovery, publish: Callable[[], None]) -> None:
        self._worker = worker
        self._server_url = server_url
        self._client = client
        self._watch = watch
        self._in_flight = in_flight
        self._discovery = discovery
        # Tells the registry at once when the server leaves or rejoins the rotation.
        self._publish = publish
        # Consecutive failed /health probes; the consumer gate reads it (gate.py).
        self.failures = 0

    @property
    def in_rotation(self) -> bool:
        return self._watch.rotation.in_rotation

    async def probe_forever(self) -> None:
        while True:
            if await self._client.ready():
                if self.failures:
                    self._restarted()
                    await self._discovery.refresh_soon()
                self.failures = 0
            else:
                self.failures += 1
            await asyncio.sleep(HEALTH_PROBE_S)

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
            await asyncio.sleep(rotation.next_probe_s())
            if self._discovery.server is None:
                continue
            try:
                await self._discovery.probe()
            except (BadRequestError, OverloadedError):
                pass  # refused or full, but running requests: fit to take work
            except GenerationError as exc:
                log.info("worker %s: %s still out of rotation (probe %d: %s)", self._worker,
                         self._server_url, rotation.probes, exc)
                continue
            out_s = time.time() - (rotation.out_since or time.time())
            rotation.rejoin()
            log.warning("worker %s: %s answered a probe; back in rotation after %.0fs",
                        self._worker, self._server_url, out_s)
            metrics.set_in_rotation(self._worker, self._server_url, True)
            self._publish()

    def refused(self, exc: BadRequestError) -> None:
        """A request the server refused (4xx): the server works."""
        self._watch.refused(exc)
        metrics.request_refused(self._worker, self._server_url, "refused", exc.status)

    def request_failed(self, exc: GenerationError) -> bool:
        """A server-caused failure; True when the server is (now) out of rotation."""
        # The failed request gave its slot back: what holds one is running.
        ejected = self._watch.failed(exc, self._in_flight.active)
        metrics.request_refused(self._worker, self._server_url, "failed", exc.status)
        if ejected:
            self._ejected()
        return not self.in_rotation

    def eject(self, reason: str) -> None:
        """Take the server out of rotation (a prompt's tries all failed and a probe failed)."""
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
        probes = AsyncRetrying(retry=retry_if_result(lambda ready: not ready),
                               stop=stop_before_delay(deadline_s),
                               wait=backoff(READY_BACKOFF_S, READY_BACKOFF_MAX_S))
        try:
            await probes(self._client.ready)
        except RetryError:
            raise ServerDownError(f"{self._server_url} not ready after {deadline_s:.0f}s") from None
        await self._discovery.refresh_soon()

    def report(self) -> ServerHealth:
        """How the server treated this worker's requests lately (`status`, Flower, metrics)."""
        return self._watch.health(self._in_flight.limit, self._in_flight.reason)

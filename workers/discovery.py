"""What the worker's server is: found at first contact and again every
FLEETGEN_CAPACITY_REFRESH_S, its kind, the models it serves, what it refused of what fleetgen
adds (fleetgen/servers), and with that how many requests it takes at once (workers/limits.py).

Batches wait for the first contact (`connected`). What an earlier contact learned is kept
while the server found is the same kind serving the same models. A one-token probe (`probe`)
teaches what the server refuses before any prompt is sent, and tells a server out of rotation
alive again (workers/healthcheck.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable

from fleetgen.errors import (
    BadRequestError,
    FleetgenError,
    GenerationError,
    RetryableError,
    ServerDownError,
)
from fleetgen.servers import RequestBody, Server, ServerCapacity
from fleetgen.settings import Settings
from workers.client import ServerClient
from workers.flow import PROBE_TIMEOUT_S
from workers.limits import InFlight

log = logging.getLogger(__name__)
# The one-token request that times a server's queue and tells a server out of rotation alive.
PROBE_BODY: RequestBody = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
# A server that has not answered the first probe by then is used without what it would have
# taught (the model it is pinned to is then learned from the first prompt's refusal).
FIRST_PROBE_S = 10.0
# Requests that found the server back at once refresh what is known of it once.
REFRESH_AGAIN_S = 1.0
# While the server cannot be read, it is tried again this often.
UNREAD_AGAIN_S = 1.0


class Discovery:
    """The server as found (`server`, None until it answered once) and how it is found again."""

    def __init__(self, settings: Settings, worker: str, server_url: str, client: ServerClient,
                 in_flight: InFlight, publish: Callable[[], None]) -> None:
        self._settings = settings
        self._worker = worker
        self._server_url = server_url
        self._client = client
        self._in_flight = in_flight
        # Tells the registry: `status` says what the server is from the first contact on.
        self._publish = publish
        self.server: Server | None = None
        self._found = asyncio.Event()
        self._refreshed_at = -math.inf

    async def connected(self, deadline_s: float) -> Server:
        """The server once it has been found (ServerDownError past the deadline)."""
        if not self._found.is_set():
            try:
                await asyncio.wait_for(self._found.wait(), deadline_s)
            except TimeoutError:
                raise ServerDownError(f"{self._server_url}: not reachable to find what it is "
                                      f"after {deadline_s:.0f}s") from None
        assert self.server is not None
        return self.server

    async def refresh(self) -> ServerCapacity:
        """Find what the server is and how many requests to keep in flight there."""
        found = await self._client.detect()
        first = self.server is None
        server = self._adopt(found)
        in_flight = self._in_flight
        if ((first and server.model is None and not server.kind.any_model)
                or in_flight.wants_idle_probe(server)):
            # Learn the served model from the server's own refusal of a probe, before any
            # prompt is sent (a server pinned to one model that /v1/models does not list);
            # and time an idle server, the probe controller's reference.
            with contextlib.suppress(GenerationError):
                idle = in_flight.active == 0
                latency = await self.probe(FIRST_PROBE_S)
                if idle:
                    in_flight.idle_probe_s = latency
        capacity = in_flight.found(server)
        if first:
            self._found.set()
            self._publish()
        return capacity

    def _adopt(self, found: Server) -> Server:
        """The server found now; what an earlier contact learned is kept while it is the same
        kind serving the same models."""
        known = self.server
        if known is not None and (known.kind, known.models) == (found.kind, found.models):
            found.refused, found.pinned = known.refused, known.pinned
            found.__post_init__()
        elif known is not None:
            log.warning("worker %s: %s changed: now %s (was %s)", self._worker,
                        self._server_url, found.describe(), known.describe())
            self._in_flight.forget(restarted=False)
        self.server = found
        return found

    async def refresh_forever(self) -> None:
        while True:
            try:
                await self.refresh()
                delay = self._settings.capacity_refresh_s
            except FleetgenError as exc:
                log.info("worker %s: capacity not readable yet (%s)", self._worker, exc)
                delay = UNREAD_AGAIN_S
            except Exception:  # a surprise must not end the loop batches wait on
                log.exception("worker %s: reading %s failed", self._worker, self._server_url)
                delay = self._settings.capacity_refresh_s
            await asyncio.sleep(delay)

    async def refresh_soon(self) -> None:
        """Find the server again (it is back), once however many requests were waiting for it."""
        now = time.monotonic()
        if now - self._refreshed_at < REFRESH_AGAIN_S:
            return
        self._refreshed_at = now
        try:
            await self.refresh()
        except FleetgenError as exc:
            log.info("worker %s: capacity not readable yet (%s)", self._worker, exc)

    async def probe(self, timeout_s: float = PROBE_TIMEOUT_S) -> float:
        """One one-token request to the server; its latency. A refusal that teaches the worker
        something (the model it is pinned to, a field it refuses) is learned and the probe
        sent again; other errors are raised (GenerationError). Unanswered within `timeout_s`,
        it is a RetryableError ("timeout"): a probe never waits on a hung server."""
        try:
            return await asyncio.wait_for(self._probe(), timeout_s)
        except TimeoutError:
            raise RetryableError(f"probe unanswered in {timeout_s:.0f}s",
                                 code="timeout") from None

    async def _probe(self) -> float:
        server = self.server
        assert server is not None
        while True:
            stored = PROBE_BODY.copy()
            if server.model is None and server.models:
                stored["model"] = server.models[0]
            body = server.prepare(stored, thinking=False)
            start = time.monotonic()
            try:
                await self._client.chat(body)
            except BadRequestError as exc:
                learned = server.learn(exc.status, exc.message, body, stored)
                if learned is None:
                    raise
                log.warning("worker %s: %s %s (it answered %s)", self._worker,
                            self._server_url, learned, exc.message[:200])
                continue
            return time.monotonic() - start

"""The worker's view of its server, as a load balancer's of a backend: what it is
(`discovery`), how many requests it takes at once (`in_flight`), whether it is fit for work
(`checks`), how loaded it is (`load`) and what the registry says of it (`registration`).

Built on the worker's loop (`Backend.open`, from workers/bridge.py's thread), where its
watchers run until `close`: the server found again every FLEETGEN_CAPACITY_REFRESH_S, its
`/health` probed every second, its load read while its capacity is measured, a server out of
rotation probed until it answers, the registry entry written every beat.

    backend = loop.run(Backend.open(settings, url, worker, queues, loop, live))
    server = await backend.discovery.connected(deadline_s)
    async with backend.in_flight.slots(1):
        reply = await backend.chat(body)
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence

from fleetgen.liveledger import LiveLedger
from fleetgen.servers import ChatCompletion, RequestBody
from fleetgen.settings import Settings
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
        # One chat completion (workers/client.py): the only request batches send themselves.
        self.chat: Callable[[RequestBody], Awaitable[ChatCompletion]] = self._client.chat
        # What its requests met, whether it is in rotation, the overload ceiling (flow.py).
        self.watch = ServerWatch()
        self.in_flight = InFlight(settings, worker, server_url, self.watch)
        self.discovery = Discovery(settings, worker, server_url, self._client, self.in_flight,
                                   lambda: self.registration.publish())
        self.checks = HealthChecks(worker, server_url, self._client, self.watch, self.in_flight,
                                   self.discovery, lambda: self.registration.publish())
        self.load = LoadWatch(worker, server_url, self._client, self.watch, self.in_flight,
                              self.discovery)
        self.registration = Registration(settings, worker, server_url, queues, loop, live,
                                         self.in_flight, self.discovery, self.checks, self.load)
        self._watchers: list[asyncio.Task[None]] = []

    @classmethod
    async def open(cls, settings: Settings, server_url: str, worker: str,
                   queues: Sequence[str], loop: LoopThread, live: LiveLedger) -> Backend:
        """The backend, its watchers started on the running loop (the worker's)."""
        backend = cls(settings, server_url, worker, queues, loop, live)
        backend._watchers = [asyncio.create_task(watcher) for watcher in (
            backend.discovery.refresh_forever(), backend.checks.probe_forever(),
            backend.load.watch_forever(), backend.checks.rotate_forever(),
            backend.registration.beat_forever())]
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

"""This worker's entry in the registry (fleetgen/fleet.py `WorkerEntry`): who it is, what it
consumes and serves, how busy its server is and why the last batch could not run here.

Written every REGISTRY_BEAT_S, and at once when something `producer status` shows changed: the
server found, out of or back in rotation, a batch that could not run. Registry entries are
readable by every Redis user, so no URL credential goes in them.

A worker still waiting for a usable server (workers/discovery.py) is `server-down`, and why it
waits is its last error for as long as it waits.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections.abc import Sequence

from fleetgen.advertise import advertised_url
from fleetgen.fleet import REGISTRY_BEAT_S, WorkerEntry, WorkerError
from fleetgen.liveledger import LiveLedger
from fleetgen.redact import redact
from fleetgen.retry import REDIS_ERRORS
from fleetgen.settings import Settings
from workers.bridge import LoopThread
from workers.discovery import Discovery
from workers.healthcheck import HealthChecks
from workers.limits import InFlight
from workers.load import LoadWatch

log = logging.getLogger(__name__)
HOST = socket.gethostname()


class Registration:
    """What the registry says of this worker, and the beat that keeps it fresh."""

    def __init__(self, settings: Settings, worker: str, server_url: str, queues: Sequence[str],
                 loop: LoopThread, live: LiveLedger, in_flight: InFlight, discovery: Discovery,
                 checks: HealthChecks, load: LoadWatch) -> None:
        self._worker = worker
        self._server_url = server_url
        self._started = time.time()
        # Published in the registry: `producer status` tells a job whose queue nobody consumes.
        self.queues = list(queues)
        # What the registry shows other nodes: server_url may be this node's loopback.
        self.advertised_url = advertised_url(server_url, settings)
        # The last thing that kept a batch from running here, for `producer status`, or None.
        self.last_error: WorkerError | None = None
        self._loop = loop
        self._live = live
        self._in_flight = in_flight
        self._discovery = discovery
        self._checks = checks
        self._load = load
        # Set at shutdown: nothing more is published.
        self.closed = False

    async def beat_forever(self) -> None:
        while True:
            self._in_flight.log_change()
            await self._register()
            await asyncio.sleep(REGISTRY_BEAT_S)

    def publish(self) -> None:
        """Register now rather than at the next beat; from any thread."""
        if not self.closed:
            self._loop.submit(self._register())

    def note_error(self, job: str, error: str) -> None:
        """Remember why a batch of `job` could not run here and publish it now (the registry
        beat keeps it there)."""
        self.last_error = WorkerError(error=redact(error), job=job, at=time.time())
        self.publish()

    async def _register(self) -> None:
        """Tell `producer status` who this worker is, what it serves, and how busy it is."""
        in_flight, checks, server = self._in_flight, self._checks, self._discovery.server
        capacity = in_flight.capacity
        waiting = self._discovery.waiting_for
        # No job is at stake: the worker takes none while it waits.
        error = (WorkerError(error=redact(waiting), job="", at=time.time()) if waiting
                 else self.last_error)
        # What the server says, for `status` where the server cannot be read live.
        reading = await self._load.read(REGISTRY_BEAT_S / 2)
        entry = WorkerEntry(
            worker=self._worker,
            host=HOST,
            pid=os.getpid(),
            queues=self.queues,
            last_error=error,
            server=self.advertised_url,
            local_server=self._server_url,
            reading=reading,
            state=("server-down" if checks.failures or waiting
                   else "ready" if checks.in_rotation else "out-of-rotation"),
            server_kind=server.describe() if server else None,
            effective_max_running_requests=capacity.effective if capacity else None,
            requested_max_running_requests=capacity.requested if capacity else None,
            capacity_source=capacity.source if capacity else None,
            limit=in_flight.limit,
            in_flight=in_flight.active,
            updated=time.time(),
            health=checks.report(),
            started=self._started,
        )
        try:
            await self._live.publish_worker(self._worker, entry.to_json())
        except REDIS_ERRORS as exc:
            log.info("worker %s: registry update skipped (%s)", self._worker, exc)

"""The server's load as its worker reads it: one reader (`LoadWatch.read`) of what the server
says of itself (its `/metrics` gauges and, for SGLang, its info: fleetgen/readings.py), on one
schedule per purpose:

- every LOAD_TICK_S while the worker measures a server that does not state its capacity
  (workers/limits.py), and requests are in flight: the running and waiting gauges feed a
  QueueWatch, or a timed one-token probe feeds a QueueProbe;
- every REGISTRY_BEAT_S (fleetgen/fleet.py) for the registry entry `producer status` shows
  (workers/registration.py).

Reads go through the client's cold endpoints, which answer a path asked again within a second
with the first answer, so the two never ask the server twice at once.
"""

from __future__ import annotations

import asyncio
import logging

from fleetgen.errors import GenerationError, OverloadedError
from fleetgen.readings import ServerReading, read_server_within
from workers.client import ServerClient
from workers.discovery import Discovery
from workers.flow import ServerWatch
from workers.limits import InFlight, QueueProbe, QueueWatch

log = logging.getLogger(__name__)
# How often a server's queue gauges are read, or a probe sent, while its capacity is found
# from them.
LOAD_TICK_S = 1.0
# While timed probes find free slots (the limit is growing), they go this often.
GROWING_TICK_S = 0.2
# A tick's reading waits this long for the server.
LOAD_READ_S = 5 * LOAD_TICK_S


class LoadWatch:
    """Reads the server's load, and feeds the in-flight limit's controller each tick."""

    def __init__(self, worker: str, server_url: str, client: ServerClient, watch: ServerWatch,
                 in_flight: InFlight, discovery: Discovery) -> None:
        self._worker = worker
        self._server_url = server_url
        self._client = client
        self._watch = watch
        self._in_flight = in_flight
        self._discovery = discovery

    async def read(self, within_s: float) -> ServerReading:
        """What the server says of itself now (a server that does not answer within `within_s`
        reads as down)."""
        client = self._client
        return await read_server_within(client.http, self._server_url, client.api_key, within_s)

    async def watch_forever(self) -> None:
        """Find the capacity of a server that does not state it: read its queue gauges, or
        time a probe, once a tick while requests are in flight."""
        while True:
            control = self._in_flight.control
            await asyncio.sleep(GROWING_TICK_S if isinstance(control, QueueProbe)
                                and control.growing else LOAD_TICK_S)
            control = self._in_flight.control
            if (self._discovery.server is None or control is None
                    or not self._watch.rotation.in_rotation):
                continue
            if isinstance(control, QueueWatch):
                await self._read_gauges()
            elif self._client.budgeted:
                # Every probe would spend the endpoint's request budget.
                self._in_flight.budgeted(self._client.requests_per_window)
            elif self._in_flight.active > 0:
                await self._time_probe()

    async def _read_gauges(self) -> None:
        reading = await self.read(LOAD_READ_S)
        if reading.running is None or reading.queue is None:
            # A missed tick; the next one reads again.
            log.debug("worker %s: /metrics unread (%s)", self._worker, reading.error or "no gauges")
            return
        self._in_flight.on_load(reading.running, reading.queue)

    async def _time_probe(self) -> None:
        in_flight = self._in_flight.active
        try:
            latency = await self._discovery.probe(LOAD_READ_S)
        except OverloadedError:
            # Refused for being full: no free slot, so no faster probing (the ceiling has it).
            if isinstance(self._in_flight.control, QueueProbe):
                self._in_flight.control.growing = False
            return
        except GenerationError as exc:
            log.debug("worker %s: probe unanswered (%s)", self._worker, exc)
            return
        self._in_flight.on_probe(latency, in_flight)

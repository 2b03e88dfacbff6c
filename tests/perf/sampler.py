"""Scrape Prometheus endpoints every ~100 ms from a background thread.

Each tick reads every target concurrently and keeps the wanted families, summed over their
label sets. The simulator computes its gauges when scraped, so one scrape is one consistent
snapshot of a server.

    with Sampler({"gpu0": url0 + "/metrics"}, SIM_FAMILIES) as sampler:
        ...
    sampler.ticks   # [Tick(t, {"gpu0": {"sglang:num_running_reqs": 40.0, ...}}), ...]
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import Self

import httpx

SIM_FAMILIES = ("sglang:num_running_reqs", "sglang:num_queue_reqs",
                "sglang:generation_tokens_total", "sglang:num_requests_total",
                "sglang:num_used_tokens")
WORKER_FAMILIES = ("fleetgen_requests_in_flight", "fleetgen_worker_max_in_flight_requests")
INTERVAL_S = 0.1


@dataclass(frozen=True)
class Tick:
    """One round of scrapes: monotonic time and, per target, family -> value (missing if down)."""

    t: float
    values: Mapping[str, Mapping[str, float]]


def parse(text: str, families: Iterable[str]) -> dict[str, float]:
    """Sum each wanted family's samples in a Prometheus text exposition."""
    wanted = tuple(families)
    sums = dict.fromkeys(wanted, 0.0)
    for line in text.splitlines():
        if not line.startswith(wanted):
            continue
        name = line.partition("{")[0] if "{" in line else line.partition(" ")[0]
        if name in sums:
            sums[name] += float(line.rsplit(" ", 1)[1])
    return sums


class Sampler:
    """Scrapes `targets` (name -> /metrics URL) every INTERVAL_S until closed."""

    def __init__(self, targets: Mapping[str, str], families: Iterable[str],
                 interval_s: float = INTERVAL_S) -> None:
        self.targets = dict(targets)
        self.families = tuple(families)
        self.interval_s = interval_s
        self.ticks: list[Tick] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="perf-sampler", daemon=True)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        """Stop sampling and wait for the thread."""
        self._stop.set()
        self._thread.join(timeout=10)

    def latest(self) -> Tick | None:
        """The last complete tick, if any."""
        return self.ticks[-1] if self.ticks else None

    def _run(self) -> None:
        asyncio.run(self._sample_forever())

    async def _sample_forever(self) -> None:
        async with httpx.AsyncClient(timeout=2.0) as client:
            next_at = time.monotonic()
            while not self._stop.is_set():
                results = await asyncio.gather(
                    *(self._scrape(client, url) for url in self.targets.values()))
                values = dict(zip(self.targets, results, strict=False))
                self.ticks.append(Tick(time.monotonic(), values))
                # Fixed cadence: a slow tick is not followed by a burst of catch-up scrapes.
                next_at = max(next_at + self.interval_s, time.monotonic())
                await asyncio.sleep(next_at - time.monotonic())

    async def _scrape(self, client: httpx.AsyncClient, url: str) -> dict[str, float]:
        try:
            response = await client.get(url)
        except httpx.HTTPError:
            return {}
        return parse(response.text, self.families) if response.status_code == 200 else {}

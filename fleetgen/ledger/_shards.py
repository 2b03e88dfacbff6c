"""Shards: the Redis servers the ledger's per-job keys are spread over, and which one holds a job.

A fleet has one broker and registry Redis (REDIS_URL: Celery's queues, the workers' registry,
the reconciler's turn) and one or more ledger shards. REDIS_URL's server is shard 0 (`FLEET`);
FLEETGEN_LEDGER_URLS adds the others. The per-prompt ledger work (checkpoints, counters,
leases, tallies) is what costs Redis its CPU, so a job's keys, and the active and finished
indexes it is filed in, live on one shard; the broker's one message per batch stays on
REDIS_URL. `place` puts a new job on the reachable shard with the fewest active jobs (a shard
just added takes the new jobs until it has its share) and records it in fg:placement on
REDIS_URL; a job it does not name is on shard 0, as every job made before the shards was.

With no extra shard nothing is looked up: one client serves every job, as before.

    shards = Shards(fleet, {"10.0.0.3:6379/0": other})
    shards.place("distill-v1")           # "10.0.0.3:6379/0"
    shards.client("distill-v1")          # `other`
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import TypeVar

import redis

from fleetgen import keys
from fleetgen.retry import REDIS_ERRORS
from fleetgen.settings import SettingsError

log = logging.getLogger(__name__)

# The name of REDIS_URL's server among the shards: fixed, not derived from REDIS_URL, whose
# spelling may differ from node to node (a loopback address on the control node, a routable
# one on the GPU nodes, a Sentinel URL).
FLEET = "redis_url"

T = TypeVar("T")


class Shards:
    """The fleet's Redis (shard 0, `FLEET`) and the extra ledger shards by name; which one
    holds each job (fg:placement, read once per job and process: a placement never changes)."""

    def __init__(self, fleet: redis.Redis,
                 extra: Mapping[str, redis.Redis] | None = None) -> None:
        self.fleet = fleet
        self._clients: dict[str, redis.Redis] = {FLEET: fleet, **(extra or {})}
        self._placed: dict[str, str] = {}
        # Extra shards a listing found out of reach: their jobs wait, the others' go on.
        self.down: set[str] = set()

    @classmethod
    def of(cls, client: redis.Redis | Shards) -> Shards:
        """`client` as the only shard, or the shards given."""
        return client if isinstance(client, Shards) else cls(client)

    @property
    def several(self) -> bool:
        return len(self._clients) > 1

    def names(self) -> list[str]:
        """Every shard's name, shard 0 first."""
        return list(self._clients)

    def all(self) -> list[tuple[str, redis.Redis]]:
        """(name, client) of every shard, shard 0 first."""
        return list(self._clients.items())

    def name_of(self, job: str) -> str:
        """The shard holding `job`'s keys: its placement, else shard 0."""
        if not self.several:
            return FLEET
        name = self._placed.get(job)
        if name is None:
            raw = self.fleet.hget(keys.PLACEMENT, job)
            if not isinstance(raw, bytes):
                return FLEET  # not placed (yet): not cached, its enqueue may place it now
            name = placed_on(job, raw, self._clients)
            self._placed[job] = name
        return name

    def client(self, job: str) -> redis.Redis:
        """The client of the shard holding `job`'s keys."""
        return self._clients[self.name_of(job)]

    def place(self, job: str) -> str:
        """The shard of `job`, placing it first if it has none: the one it is recorded on, shard
        0 for a job shard 0 already holds, else the reachable shard with the fewest active jobs
        (the first listed of those tied). Two enqueues of one new job agree (the first record
        wins)."""
        if not self.several:
            return FLEET
        raw = self.fleet.hget(keys.PLACEMENT, job)
        if isinstance(raw, bytes):
            return self.name_of(job)
        if self.fleet.exists(keys.job(job)):
            chosen = FLEET
        else:
            loads = self.each(lambda r: int(r.scard(keys.JOBS)))
            chosen = min(loads, key=lambda name: loads[name])
        self.fleet.hsetnx(keys.PLACEMENT, job, chosen)
        return self.name_of(job)

    def group(self, jobs: Iterable[str]) -> list[tuple[redis.Redis, list[str]]]:
        """(a shard's client, those of `jobs` it holds, in their order) for each shard holding
        any: what a read of several jobs sends to each."""
        out: dict[str, list[str]] = {}
        for job in jobs:
            out.setdefault(self.name_of(job), []).append(job)
        return [(self._clients[name], group) for name, group in out.items()]

    def each(self, read: Callable[[redis.Redis], T]) -> dict[str, T]:
        """Shard name -> what `read` found on it, for every shard within reach. An extra shard
        out of reach is left out (its jobs wait while the others go on) and named in `down`;
        shard 0 out of reach raises, as the broker is out of reach with it."""
        found: dict[str, T] = {}
        for name, client in self._clients.items():
            if name == FLEET:
                found[name] = read(client)
                continue
            try:
                found[name] = read(client)
            except REDIS_ERRORS as exc:
                if name not in self.down:
                    log.warning("ledger shard %s: out of reach (%s); its jobs wait", name, exc)
                self.down.add(name)
                continue
            if name in self.down:
                log.warning("ledger shard %s: back within reach", name)
                self.down.discard(name)
        return found

    def close(self) -> None:
        for client in self._clients.values():
            client.close()


def placed_on(job: str, raw: bytes, known: Collection[str]) -> str:
    """The shard name fg:placement holds for `job` (`raw`), which must be one of `known`: a
    process not given the same FLEETGEN_LEDGER_URLS as the enqueue would look for the job's
    keys on the wrong server."""
    name = raw.decode()
    if name not in known:
        raise SettingsError(
            f"job {job} is on the ledger shard {name}, which this process does not know: "
            "give every process the same FLEETGEN_LEDGER_URLS")
    return name

"""Shards: the Redis servers the ledger's per-job keys are spread over, and which one holds a job.

A fleet has one broker and registry Redis (REDIS_URL: Celery's queues, the workers' registry,
the reconciler's turn) and one or more ledger shards. REDIS_URL's server is shard 0 (`FLEET`);
FLEETGEN_LEDGER_URLS adds the others. The per-prompt ledger work (checkpoints, counters,
leases, tallies) is what costs Redis its CPU, so a job's keys, and the active and finished
indexes it is filed in, live on one shard; the broker's one message per batch stays on
REDIS_URL. `place` puts a new job on the reachable shard with the fewest active jobs (a shard
just added takes the new jobs until it has its share) and records it in fg:placement on
REDIS_URL; a job it does not name is on shard 0, as every job made before the shards was.

A shard names itself: its server holds its name in fg:shard, written once (SET NX) by the
first process that reached it as a shard, the address that process gave it and a random tail
(`10.0.0.3:6379/0~4be1c2`). A placement records that name, so processes that spell a server
differently (a loopback address on one node, a routable one on another) agree. A process reads
each configured server's name once, when it first needs one (`Identities`), and refuses two
URLs that turn out to be one server. Shard 0 is `FLEET` whatever its URL.

With no extra shard nothing is looked up: one client serves every job, as before; a job this
process cannot find is looked for in fg:placement then, to say which shard it is on.

    shards = Shards(fleet, {"10.0.0.3:6379/0": other})
    shards.place("distill-v1")           # "10.0.0.3:6379/0~4be1c2"
    shards.client("distill-v1")          # `other`
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable, Iterable, Mapping
from functools import partial
from typing import TypeVar

import redis

from fleetgen import keys
from fleetgen.ledger._replies import script
from fleetgen.retry import REDIS_ERRORS, RedisConnectionError
from fleetgen.settings import SettingsError

log = logging.getLogger(__name__)

# The name of REDIS_URL's server among the shards: fixed, not derived from REDIS_URL, whose
# spelling may differ from node to node (a loopback address on the control node, a routable
# one on the GPU nodes, a Sentinel URL).
FLEET = "redis_url"
# A finished job's placement goes this long after its keys expired: the expiry was reckoned by
# the clock of the process that settled the job, the purge by another's.
PLACEMENT_GRACE_S = 3600.0

T = TypeVar("T")

_EXPIRE_PLACEMENTS = script("expire_placements.lua")


class UnknownShardError(SettingsError):
    """A job is placed on a ledger shard this process was not given (FLEETGEN_LEDGER_URLS)."""

    def __init__(self, job: str, shard: str) -> None:
        super().__init__(
            f"job {job} is on the ledger shard {shard}, which this process was not given: "
            f"FLEETGEN_LEDGER_URLS must list that shard's Redis (give every process the same "
            f"list)")
        self.job, self.shard = job, shard


def mint(address: str) -> str:
    """A new shard's name: the address it was first reached at, and a random tail that keeps
    two servers first reached at the same address (each node's own loopback) apart."""
    return f"{address}~{secrets.token_hex(3)}"


def identify(client: redis.Redis, address: str) -> str:
    """The name the server of `client` holds in fg:shard, written first if it has none
    (`FLEET` on REDIS_URL's, else `mint(address)`)."""
    with client.pipeline(transaction=False) as p:
        p.set(keys.SHARD, FLEET if address == FLEET else mint(address), nx=True)
        p.get(keys.SHARD)
        _, raw = p.execute()
    return bytes(raw).decode()


class Identities:
    """Which configured server is which shard: identity -> the address it was configured by,
    and the addresses whose identity is not read yet (their server did not answer). Shared by
    the synchronous `Shards` and the worker's `LiveLedger`, which read fg:shard their own way.
    """

    def __init__(self, addresses: Iterable[str]) -> None:
        self.unread: list[str] = [a for a in addresses if a != FLEET]
        self.address: dict[str, str] = {FLEET: FLEET}
        # What fg:shard holds on REDIS_URL's server (`FLEET` unless it was once an extra shard).
        self.fleet: str | None = None

    def learn(self, address: str, identity: str) -> None:
        """`address`'s server is the shard `identity`; SettingsError if another configured URL
        (REDIS_URL's included) is that server already."""
        if address == FLEET:
            self.fleet = identity
            self.address[identity] = FLEET
            return
        if identity == self.fleet:
            raise SettingsError(f"FLEETGEN_LEDGER_URLS: {address} is REDIS_URL's own server "
                                f"(ledger shard {identity}): leave it out of the list")
        if identity in self.address:
            raise SettingsError(f"FLEETGEN_LEDGER_URLS: {self.address[identity]} and {address} "
                                f"are the same server (ledger shard {identity}): list it once")
        self.address[identity] = address
        self.unread.remove(address)

    def missing(self, job: str, shard: str) -> Exception:
        """Why `shard`, which holds `job`, has no client here: a configured server that did not
        answer may be it (a connection error: its jobs wait), else no URL names it."""
        if self.unread:
            return RedisConnectionError(
                f"ledger shard {shard} (job {job}) not found among the servers that answered; "
                f"{', '.join(self.unread)} did not answer")
        return UnknownShardError(job, shard)


class Shards:
    """The fleet's Redis (shard 0, `FLEET`) and the extra ledger shards by address; which one
    holds each job (fg:placement, read once per job and process: a placement never changes)."""

    def __init__(self, fleet: redis.Redis,
                 extra: Mapping[str, redis.Redis] | None = None) -> None:
        self.fleet = fleet
        # address -> client: FLEET, and the address each FLEETGEN_LEDGER_URLS entry names.
        self._clients: dict[str, redis.Redis] = {FLEET: fleet, **(extra or {})}
        self.ids = Identities(self._clients)
        self._placed: dict[str, str] = {}
        # Extra shards a listing found out of reach (their name, else their address): their
        # jobs wait, the others' go on.
        self.down: set[str] = set()
        self._expire = fleet.register_script(_EXPIRE_PLACEMENTS)

    @classmethod
    def of(cls, client: redis.Redis | Shards) -> Shards:
        """`client` as the only shard, or the shards given."""
        return client if isinstance(client, Shards) else cls(client)

    @property
    def several(self) -> bool:
        return len(self._clients) > 1

    def names(self) -> list[str]:
        """The name of every shard whose server answered, shard 0 first."""
        self._read_identities()
        return list(self.ids.address)

    def name_of(self, job: str) -> str:
        """The shard holding `job`'s keys: its placement, else shard 0."""
        if not self.several:
            return FLEET
        name = self._placed.get(job)
        if name is None:
            raw = self.fleet.hget(keys.PLACEMENT, job)
            if not isinstance(raw, bytes):
                return FLEET  # not placed (yet): not cached, its enqueue may place it now
            name = self._placed[job] = raw.decode()
        if name not in self.ids.address:
            self._read_identities()
            if name not in self.ids.address:
                raise self.ids.missing(job, name)
        return name

    def client(self, job: str) -> redis.Redis:
        """The client of the shard holding `job`'s keys."""
        return self._clients[self.ids.address[self.name_of(job)]]

    def elsewhere(self, job: str) -> UnknownShardError | None:
        """For a job not found on shard 0 by a process given no extra shard: the error naming
        the shard fg:placement puts it on, if any. Read only then, so that one Redis costs
        nothing more."""
        if self.several:
            return None
        raw = self.fleet.hget(keys.PLACEMENT, job)
        if not isinstance(raw, bytes) or raw.decode() == FLEET:
            return None
        return UnknownShardError(job, raw.decode())

    def strangers(self) -> dict[str, list[str]]:
        """Shards fg:placement names that this process does not know -> their jobs: what a
        listing here leaves out. One read of fg:placement (the listing's only)."""
        self._read_identities()
        out: dict[str, list[str]] = {}
        placements: dict[bytes, bytes] = self.fleet.hgetall(keys.PLACEMENT)  # type: ignore[assignment]
        for job, raw in placements.items():
            name = raw.decode()
            if name not in self.ids.address and name not in self.down:
                out.setdefault(name, []).append(job.decode())
        return out

    def out_of_reach(self, job: str) -> str | None:
        """The shard holding `job` if it is an extra one that does not answer now (by its name,
        as placed), else None: a Redis error about `job` came from elsewhere."""
        name = self._placed.get(job)
        if name is None or self.ids.address.get(name) == FLEET:
            return None
        address = self.ids.address.get(name)
        if address is None:
            return name  # its server is among those whose name could not be read
        try:
            self._clients[address].ping()
        except REDIS_ERRORS:
            return name
        return None

    def place(self, job: str) -> str:
        """The shard of `job`, placing it first if it has none: the one it is recorded on, the
        shard that already holds its hash, else the reachable shard with the fewest active jobs
        (the first listed of those tied). Two enqueues of one new job agree (the first record
        wins); a placement due to expire with its finished job's keys stays."""
        if not self.several:
            return FLEET
        raw = self.fleet.hget(keys.PLACEMENT, job)
        if isinstance(raw, bytes):
            chosen = raw.decode()
        else:
            holders = self.each(lambda r: bool(r.exists(keys.job(job))))
            held = [name for name, there in holders.items() if there]
            if held:
                chosen = held[0]
            else:
                loads = self.each(lambda r: int(r.scard(keys.JOBS)))
                chosen = min(loads, key=lambda name: loads[name])
        with self.fleet.pipeline() as p:
            p.hsetnx(keys.PLACEMENT, job, chosen)
            p.zrem(keys.PLACEMENT_EXPIRY, job)
            p.execute()
        self._placed.pop(job, None)
        return self.name_of(job)

    def expire(self, job: str, expiry_ms: int | None, now: float) -> None:
        """Let `job`'s placement go `PLACEMENT_GRACE_S` after its keys expire at `expiry_ms`
        (None: it runs again, and keeps it), dropping those due by `now`."""
        if not self.several:
            return
        if expiry_ms is None:
            self.fleet.zrem(keys.PLACEMENT_EXPIRY, job)
            return
        self._expire(keys=[keys.PLACEMENT, keys.PLACEMENT_EXPIRY],
                     args=[job, expiry_ms, int((now - PLACEMENT_GRACE_S) * 1000)])

    def group(self, jobs: Iterable[str]) -> list[tuple[redis.Redis, list[str]]]:
        """(a shard's client, those of `jobs` it holds, in their order) for each shard holding
        any: what a read of several jobs sends to each."""
        out: dict[str, list[str]] = {}
        for job in jobs:
            out.setdefault(self.name_of(job), []).append(job)
        return [(self._clients[self.ids.address[name]], group) for name, group in out.items()]

    def each(self, read: Callable[[redis.Redis], T]) -> dict[str, T]:
        """Shard name -> what `read` found on it, for every shard within reach. An extra shard
        out of reach is left out (its jobs wait while the others go on) and named in `down`;
        shard 0 out of reach raises, as the broker is out of reach with it."""
        if not self.several:
            return {FLEET: read(self.fleet)}
        self._read_identities()
        found: dict[str, T] = {}
        for name, address in list(self.ids.address.items()):
            if address == FLEET:
                found[FLEET] = read(self.fleet)
                continue
            value = self._within_reach(name, read, self._clients[address])
            if value is not None:
                found[name] = value[0]
        return found

    def close(self) -> None:
        for client in self._clients.values():
            client.close()

    def _read_identities(self) -> None:
        """Read the name of each configured server not named yet (REDIS_URL's first, against
        which the others are checked); one out of reach is named in `down` by its address."""
        if self.ids.fleet is None and self.several:
            self.ids.learn(FLEET, identify(self.fleet, FLEET))
        for address in list(self.ids.unread):
            found = self._within_reach(address, partial(identify, address=address),
                                       self._clients[address])
            if found is not None:
                self.ids.learn(address, found[0])

    def _within_reach(self, name: str, read: Callable[[redis.Redis], T],
                      client: redis.Redis) -> tuple[T] | None:
        """(what `read` returned) from an extra shard, or None when it is out of reach, said
        once as it goes and once as it comes back."""
        try:
            value = read(client)
        except REDIS_ERRORS as exc:
            if name not in self.down:
                log.warning("ledger shard %s: out of reach (%s); its jobs wait", name, exc)
            self.down.add(name)
            return None
        if name in self.down:
            log.warning("ledger shard %s: back within reach", name)
            self.down.discard(name)
        return (value,)


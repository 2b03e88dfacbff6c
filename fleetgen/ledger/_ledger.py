"""The ledger: its Redis clients (REDIS_URL's and the ledger shards') and the parts of the job's
state it holds."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import redis

from fleetgen import redisconn
from fleetgen.ledger._batches import Batches
from fleetgen.ledger._counters import Counters
from fleetgen.ledger._guards import Guards
from fleetgen.ledger._jobs import Jobs
from fleetgen.ledger._leases import Leases
from fleetgen.ledger._registry import Registry
from fleetgen.ledger._rounds import Rounds
from fleetgen.ledger._shards import Shards
from fleetgen.settings import JOB_RETENTION_S, REDIS_MASTER_NAME, Settings, ledger_shard_name


class Ledger:
    """Synchronous ledger operations by what the keys are, each routed to the Redis holding the
    job it names (`shards`: REDIS_URL's alone unless FLEETGEN_LEDGER_URLS adds others):

        ledger = Ledger.connect(settings)
        attempt = ledger.leases.acquire(job, batch, token, settings.lease_ttl_s)
        ledger.batches.finish_and_settle(job, batch, written, worker, failures)

    `r` is REDIS_URL's client: the broker's and the registry's, and shard 0.
    """

    def __init__(self, client: redis.Redis, job_retention: float = JOB_RETENTION_S,
                 shards: Mapping[str, redis.Redis] | None = None) -> None:
        self.r = client
        self.shards = Shards(client, shards)
        self.jobs = Jobs(self.shards, job_retention)
        self.batches = Batches(self.shards, self.jobs)
        self.leases = Leases(self.shards)
        self.counters = Counters(self.shards)
        self.rounds = Rounds(self.shards)
        self.guards = Guards(self.shards)
        self.registry = Registry(client)

    @classmethod
    def from_url(cls, url: str, client_name: str | None = None,
                 master_name: str = REDIS_MASTER_NAME,
                 job_retention: float = JOB_RETENTION_S,
                 ledger_urls: Sequence[str] = ()) -> Ledger:
        """A ledger on the Redis `url` names (a server, or the master of Sentinels), its jobs'
        keys spread over it and the servers `ledger_urls` name (FLEETGEN_LEDGER_URLS)."""
        options: dict[str, Any] = {"socket_timeout": 30, "socket_connect_timeout": 5,
                                   "health_check_interval": 10, "client_name": client_name}
        extra = {ledger_shard_name(u): redisconn.client(u, master_name, **options)
                 for u in ledger_urls}
        return cls(redisconn.client(url, master_name, **options), job_retention, extra)

    @classmethod
    def connect(cls, settings: Settings, client_name: str | None = None) -> Ledger:
        return cls.from_url(settings.redis_url, client_name, settings.redis_master_name,
                            settings.job_retention, settings.ledger_urls)

    def close(self) -> None:
        """Close the connection pools (a short-lived ledger, such as the start checks')."""
        self.shards.close()

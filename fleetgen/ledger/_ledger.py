"""The ledger: one Redis client and the parts of the job's state it holds."""

from __future__ import annotations

import redis

from fleetgen import redisconn
from fleetgen.ledger._batches import Batches
from fleetgen.ledger._counters import Counters
from fleetgen.ledger._guards import Guards
from fleetgen.ledger._jobs import Jobs
from fleetgen.ledger._leases import Leases
from fleetgen.ledger._registry import Registry
from fleetgen.ledger._rounds import Rounds
from fleetgen.settings import JOB_RETENTION_S, REDIS_MASTER_NAME, Settings


class Ledger:
    """Synchronous ledger operations on one Redis connection pool, by what the keys are:

        ledger = Ledger.connect(settings)
        attempt = ledger.leases.acquire(job, batch, token, settings.lease_ttl_s)
        ledger.batches.finish_and_settle(job, batch, written, worker, failures)
    """

    def __init__(self, client: redis.Redis, job_retention: float = JOB_RETENTION_S) -> None:
        self.r = client
        self.jobs = Jobs(client, job_retention)
        self.batches = Batches(client, self.jobs)
        self.leases = Leases(client)
        self.counters = Counters(client)
        self.rounds = Rounds(client)
        self.guards = Guards(client)
        self.registry = Registry(client)

    @classmethod
    def from_url(cls, url: str, client_name: str | None = None,
                 master_name: str = REDIS_MASTER_NAME,
                 job_retention: float = JOB_RETENTION_S) -> Ledger:
        """A ledger on the Redis `url` names: a server, or the master of Sentinels."""
        return cls(redisconn.client(
            url, master_name, socket_timeout=30, socket_connect_timeout=5,
            health_check_interval=10, client_name=client_name), job_retention)

    @classmethod
    def connect(cls, settings: Settings, client_name: str | None = None) -> Ledger:
        return cls.from_url(settings.redis_url, client_name, settings.redis_master_name,
                            settings.job_retention)

    def close(self) -> None:
        """Close the connection pool (a short-lived ledger, such as the start checks')."""
        self.r.close()

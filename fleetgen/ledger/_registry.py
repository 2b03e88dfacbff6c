"""The fleet as Redis sees it: the workers' registry, their connections, the reconciler's turn
and the leases it found without an owner."""

from __future__ import annotations

import math
from typing import Any

import redis

from fleetgen import keys


class Registry:
    """The workers' registry (fg:workers: worker -> its entry, JSON: fleetgen/fleet.py
    `WorkerEntry`), what each node's tuning does (fg:tuning), the names of Redis's open
    connections (a worker's carry its name: keys.worker_client), the reconciler's lock
    (fg:reconciler) and the ownerless leases (fg:ownerless)."""

    def __init__(self, client: redis.Redis) -> None:
        self.r = client

    def entries(self) -> dict[str, bytes]:
        """Worker -> its registry entry as it wrote it."""
        raw: dict[bytes, bytes] = self.r.hgetall(keys.WORKERS)  # type: ignore[assignment]
        return {name.decode(): entry for name, entry in raw.items()}

    def entry(self, worker: str) -> bytes | None:
        """The registry entry last published under the worker name `worker`, or None."""
        raw = self.r.hget(keys.WORKERS, worker)
        return raw if isinstance(raw, bytes) else None

    def tuning(self) -> dict[str, bytes]:
        """Node -> what its tuning last published (fleetgen/fleet.py `TuningNote`)."""
        raw: dict[bytes, bytes] = self.r.hgetall(keys.TUNING)  # type: ignore[assignment]
        return {node.decode(): note for node, note in raw.items()}

    def publish_tuning(self, node: str, note: bytes, ttl_s: float) -> str | None:
        """Keep `note` as what `node`'s tuning does now, the notes of every node for `ttl_s`
        more (no note outlives the last tuner that wrote one); why not when Redis is out of
        reach (the note is what a tuning says of itself, never worth stopping it for)."""
        try:
            with self.r.pipeline() as p:
                p.hset(keys.TUNING, node, note)
                p.expire(keys.TUNING, math.ceil(ttl_s))
                p.execute()
        except (redis.RedisError, OSError) as exc:
            return str(exc) or type(exc).__name__
        return None

    def workers(self) -> list[str]:
        """The name of every worker in the registry."""
        return [name.decode() for name in self.r.hkeys(keys.WORKERS)]  # type: ignore[union-attr]

    def check_access(self) -> None:
        """Ping, then read the registry as every batch does first; raises what Redis answers
        when it is out of reach, refuses the password or the user's ACL denies a command (the
        worker's start checks, workers/preflight.py)."""
        self.r.ping()
        self.r.hlen(keys.WORKERS)

    def client_names(self) -> set[str] | None:
        """The names of every open Redis connection; None where this Redis refuses CLIENT LIST
        (some managed services)."""
        try:
            clients: list[dict[str, Any]] = self.r.client_list()
        except redis.ResponseError:
            return None
        return {str(c.get("name") or "") for c in clients}

    def take_reconciler_turn(self, owner: str, ttl_ms: int) -> bool:
        """Whether this reconciler runs the round (one at a time over the whole fleet)."""
        return bool(self.r.set(keys.RECONCILER_LOCK, owner, nx=True, px=ttl_ms))

    def ownerless_leases(self) -> set[str]:
        """Leases whose owner had no Redis connection in the last round."""
        return {raw.decode() for raw in self.r.smembers(keys.OWNERLESS)}  # type: ignore[union-attr]

    def set_ownerless_leases(self, leases: set[str], ttl_ms: int) -> None:
        with self.r.pipeline() as p:
            p.delete(keys.OWNERLESS)
            if leases:
                p.sadd(keys.OWNERLESS, *leases)
                p.pexpire(keys.OWNERLESS, ttl_ms)
            p.execute()

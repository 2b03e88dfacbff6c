"""Leases: who holds a batch right now (fg:lease:{job}:{batch}), the attempts it has spent and
why its last one ended."""

from __future__ import annotations

import time
from typing import Any

import redis

from fleetgen import keys
from fleetgen.ledger._replies import script, text
from fleetgen.ledger._shards import Shards

# Extends a lease only for its owner (the batch runner's heartbeat runs it on its loop:
# fleetgen/liveledger.py).
RENEW_LEASE = script("renew_lease.lua")
# Takes a lease, counts its attempt and moves its batch to running: one call per batch.
_ACQUIRE = script("acquire_lease.lua")
# Gives a lease back if still held, refunding the attempt if asked.
_RELEASE = script("release_lease.lua")


class Leases:
    """A batch's lease, its attempts (fg:job:{job}:attempts) and their causes
    (fg:job:{job}:causes). Taking a lease moves the batch from queued to running."""

    def __init__(self, client: redis.Redis | Shards) -> None:
        self.shards = Shards.of(client)
        self._acquire = self.shards.fleet.register_script(_ACQUIRE)
        self._release = self.shards.fleet.register_script(_RELEASE)

    def acquire(self, name: str, batch: str, token: str, ttl_s: float) -> int | None:
        """Take the batch's lease; returns the attempt number, or None if someone holds it."""
        attempt = self._acquire(
            keys=[keys.lease(name, batch), keys.job_part(name, "attempts"),
                  keys.job_part(name, "queued"), keys.job_part(name, "running")],
            args=[token, int(ttl_s * 1000), batch, time.time()], client=self.shards.client(name))
        return None if attempt is None else int(attempt)

    def release(self, name: str, batch: str, token: str, *, refund: bool) -> bool:
        """Give the lease back if `token` still holds it; True if it did.

        `refund` returns the attempt taken with the lease: the batch was handed back (pause,
        cancel, shutdown, server or sink down), so it must not count toward the batch's limit.
        Without it the attempt stays spent: the reconciler breaks the lease of a worker that
        died holding the batch this way.
        """
        return bool(self._release(
            keys=[keys.lease(name, batch), keys.job_part(name, "attempts"),
                  keys.job_part(name, "running")],
            args=[token, "1" if refund else "0", batch], client=self.shards.client(name)))

    def refund(self, name: str, batch: str) -> None:
        """Give back an attempt whose lease was lost while its worker lived (it noticed)."""
        self.shards.client(name).hincrby(keys.job_part(name, "attempts"), batch, -1)

    def attempts(self, name: str, batch: str) -> int:
        """Attempts the batch has spent, counting one held right now."""
        return int(self.shards.client(name).hget(keys.job_part(name, "attempts"), batch) or 0)

    def note_cause(self, name: str, batch: str, cause: str) -> None:
        """Why the batch's last attempt ended without finishing (kept for the limit's reason)."""
        self.shards.client(name).hset(keys.job_part(name, "causes"), batch, cause)

    def last_cause(self, name: str, batch: str) -> str:
        return text(self.shards.client(name).hget(keys.job_part(name, "causes"), batch))

    def alive(self, name: str, batch: str) -> bool:
        return bool(self.shards.client(name).exists(keys.lease(name, batch)))

    def token(self, name: str, batch: str) -> str | None:
        raw: Any = self.shards.client(name).get(keys.lease(name, batch))
        return raw.decode() if raw is not None else None

    def tokens(self, name: str, batches: list[str]) -> dict[str, str | None]:
        """Batch -> the token holding its lease (None: no live lease), read in one call: the
        reconciler's round reads every running batch's."""
        if not batches:
            return {}
        raw: list[Any] = self.shards.client(name).mget(
            [keys.lease(name, batch) for batch in batches])
        return {batch: None if value is None else value.decode()
                for batch, value in zip(batches, raw, strict=True)}

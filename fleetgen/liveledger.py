"""The ledger's asyncio side: what a worker's loop reads and writes in Redis while it runs
batches (the synchronous `Ledger` is everyone else's, the batch runner's pool threads included).

One `LiveLedger` per worker process, on its loop, over the connection pool whose connections
carry the worker's name (keys.worker_client). It holds the lease heartbeat's renewal, the job
state the heartbeat carries to a batch, the canary's and the failure breaker's reads and
pauses, and the worker's registry entry. The per-prompt checkpoints are CheckpointWriter's
(fleetgen/checkpoints.py), one per ledger shard (`checkpoint_writer`). As the `Ledger`, each
call about a job goes to the shard holding the job's keys (fg:placement, read once per job,
names the shard; each server's fg:shard, read once, says which it is: `Identities`); the
registry entry goes to REDIS_URL's server.

    live = LiveLedger.connect(settings, keys.worker_client(worker))
    if not await live.renew_lease(job, batch, token, settings.lease_ttl_s): ...
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import orjson
import redis.asyncio as aioredis
from redis.typing import EncodableT

from fleetgen import keys, redisconn
from fleetgen.canary import Sample
from fleetgen.checkpoints import CheckpointWriter, Entry, FailureJudge, Judge
from fleetgen.ledger import (
    FLEET,
    RENEW_LEASE,
    STATE_PAUSED,
    EndVerdict,
    FailureExample,
    Identities,
    QualityExample,
    mint,
)
from fleetgen.retry import REDIS_ERRORS
from fleetgen.settings import Settings, ledger_shard_name


class Checkpoints(Protocol):
    """What commits a worker's per-prompt checkpoints: a `CheckpointWriter`, or one per shard."""

    async def add(self, entry: Entry) -> bool: ...

    async def answered(self, job: str, count: int, closes: bool = False) -> None: ...


class LiveLedger:
    """Asynchronous ledger operations of one worker process, on its loop."""

    def __init__(self, client: aioredis.Redis,
                 shards: Mapping[str, aioredis.Redis] | None = None) -> None:
        self.r = client
        # address (FLEET, or as FLEETGEN_LEDGER_URLS names it) -> client
        self._shards: dict[str, aioredis.Redis] = {FLEET: client, **(shards or {})}
        self._ids = Identities(self._shards)
        self._placed: dict[str, str] = {}
        self._renew = client.register_script(RENEW_LEASE)

    @classmethod
    def connect(cls, settings: Settings, client_name: str) -> LiveLedger:
        """A live ledger on REDIS_URL and the ledger shards (FLEETGEN_LEDGER_URLS) whose
        connections are named `client_name`."""
        def client(url: str) -> aioredis.Redis:
            return redisconn.async_client(
                url, settings.redis_master_name, socket_timeout=30, socket_connect_timeout=5,
                health_check_interval=10, client_name=client_name)

        return cls(client(settings.redis_url),
                   {ledger_shard_name(url): client(url) for url in settings.ledger_urls})

    async def aclose(self) -> None:
        for client in self._shards.values():
            await client.aclose()

    def checkpoint_writer(self, worker: str, judge: Judge, canary_window: Callable[[str], int],
                          window_s: float, judge_failures: FailureJudge | None = None,
                          outcomes_kept: int = 0) -> Checkpoints:
        """The worker's group commit of per-prompt checkpoints (the arguments are
        `CheckpointWriter`'s): one writer on this ledger's client, or one per shard, each
        entry going to its job's."""
        writers = {name: CheckpointWriter(client, worker, judge, canary_window, window_s,
                                          judge_failures, outcomes_kept)
                   for name, client in self._shards.items()}
        return writers[FLEET] if len(writers) == 1 else ShardedCheckpoints(self, writers)

    async def shard(self, job: str) -> str:
        """The address of the shard holding `job`'s keys (as this process was given it; FLEET
        for REDIS_URL's): its placement, else REDIS_URL's."""
        if len(self._shards) == 1:
            return FLEET
        name = self._placed.get(job)
        if name is None:
            raw = await self.r.hget(keys.PLACEMENT, job)
            if not isinstance(raw, bytes):
                return FLEET  # not placed: not cached (`Shards.name_of`)
            name = self._placed[job] = raw.decode()
        if name not in self._ids.address:
            await self._read_identities()
            if name not in self._ids.address:
                raise self._ids.missing(job, name)
        return self._ids.address[name]

    async def _read_identities(self) -> None:
        """Each configured server's fg:shard (`fleetgen.ledger.identify`, on this loop); one
        out of reach stays unread, for the next call."""
        first = [FLEET] if self._ids.fleet is None else []
        for address in [*first, *self._ids.unread]:
            try:
                async with self._shards[address].pipeline(transaction=False) as p:
                    p.set(keys.SHARD, FLEET if address == FLEET else mint(address), nx=True)
                    p.get(keys.SHARD)
                    _, raw = await p.execute()
            except REDIS_ERRORS:
                if address == FLEET:
                    raise
                continue
            self._ids.learn(address, bytes(raw).decode())

    async def _on(self, job: str) -> aioredis.Redis:
        return self._shards[await self.shard(job)]

    # The lease heartbeat

    async def renew_lease(self, job: str, batch: str, token: str, ttl_s: float) -> bool:
        """Extend the batch's lease to `ttl_s` from now if `token` still holds it; True if it
        did (False: the lease lapsed or another copy holds it)."""
        return bool(await self._renew(keys=[keys.lease(job, batch)],
                                      args=[token, int(ttl_s * 1000)],
                                      client=await self._on(job)))

    # A rollout's journal (workers/rollouts.py): each call's result, kept until the batch is
    # written (Batches.finish_and_settle drops it with the checkpoint).

    async def journal(self, job: str, batch: str) -> dict[str, bytes]:
        """The batch's journaled calls: `keys.call_field(answer, k)` -> the call's result."""
        raw = await (await self._on(job)).hgetall(keys.calls(job, batch))
        return {k.decode(): v for k, v in raw.items()  # the client gives bytes (no decoding)
                if isinstance(k, bytes) and isinstance(v, bytes)}

    async def journal_call(self, job: str, batch: str, field: str, value: bytes) -> None:
        await (await self._on(job)).hset(keys.calls(job, batch), field, value)

    async def job_state(self, job: str) -> str | None:
        """The job's state (running, paused, cancelled ...), None if it has none."""
        raw = await (await self._on(job)).hget(keys.job(job), keys.JOB_STATE)
        return _text(raw)

    # The quality canary (workers/quality.py) and the failure breaker (fleetgen/breaker.py)

    async def canary_state(self, job: str) -> tuple[str | None, bool]:
        """The job's state, and whether `resume --accept-quality` accepted its answers."""
        state, accepted = await (await self._on(job)).hmget(
            keys.job(job), keys.JOB_STATE, keys.JOB_QUALITY_ACCEPTED)
        return _text(state), bool(accepted)

    async def recent_answers(self, job: str) -> list[Sample]:
        """The canary's window: a sample (canary.sample) of each recent answer, newest first."""
        return [Sample.from_json(x)
                for x in await (await self._on(job)).lrange(keys.job_part(job, "recent"), 0, -1)]

    async def note_canary_end(self, job: str, summary: EndVerdict) -> None:
        """What the canary made of a job smaller than its window, judged at its last answer."""
        await (await self._on(job)).hset(keys.job(job), keys.JOB_CANARY_END,
                                         orjson.dumps(summary))

    async def pause_by_canary(self, job: str, reason: str, examples: list[QualityExample],
                              seen: int) -> None:
        """Pause the job for every worker: the canary found its recent answers bad."""
        await self._pause(job, reason, {keys.JOB_QUALITY_EXAMPLES: orjson.dumps(examples),
                                        keys.JOB_QUALITY_SEEN: seen})

    async def pause_by_breaker(self, job: str, reason: str, cause: str,
                               example: FailureExample) -> None:
        """Pause the job for every worker: its prompts keep failing with `cause`."""
        await self._pause(job, reason, {keys.JOB_BREAKER_CAUSE: cause,
                                        keys.JOB_BREAKER_EXAMPLE: orjson.dumps(example)})

    async def _pause(self, job: str, reason: str, fields: Mapping[EncodableT, EncodableT]) -> None:
        mapping: dict[EncodableT, EncodableT] = {
            keys.JOB_STATE: STATE_PAUSED, keys.JOB_REASON: reason, keys.JOB_UPDATED: time.time(),
            **fields}
        await (await self._on(job)).hset(keys.job(job), mapping=mapping)

    # The workers' registry (fleetgen/fleet.py reads it)

    async def publish_worker(self, worker: str, entry: bytes) -> None:
        """Put the worker's registry entry (JSON) in place of its last one."""
        await self.r.hset(keys.WORKERS, worker, entry)


def _text(raw: Any) -> str | None:
    return raw.decode() if isinstance(raw, bytes) else None


class ShardedCheckpoints:
    """One `CheckpointWriter` per ledger shard, each entry committed by its job's: a group
    commit never spans two Redis servers."""

    def __init__(self, live: LiveLedger, writers: Mapping[str, CheckpointWriter]) -> None:
        self._live = live
        self._writers = writers

    async def add(self, entry: Entry) -> bool:
        return await self._writers[await self._live.shard(entry.job)].add(entry)

    async def answered(self, job: str, count: int, closes: bool = False) -> None:
        await self._writers[await self._live.shard(job)].answered(job, count, closes)

"""A batch's lease (workers/lease.py), against the real Valkey fixture: acquired once, ended
once, its attempt spent or refunded as `ending` says; over the attempts' limit, a late refund
is waited for before prompts fail on it."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest

from fleetgen import keys
from fleetgen.errors import LeaseLostError, ServerDownError
from fleetgen.ledger import Ledger
from fleetgen.liveledger import LiveLedger
from fleetgen.settings import Settings
from workers.bridge import LoopThread
from workers.lease import Lease

JOB, BATCH, WORKER = "leased", keys.batch_id(1), "w0@test"


@pytest.fixture
def settings(redis_url: str) -> Settings:
    return Settings(redis_url=redis_url, lease_ttl_s=1.0, lease_renew_s=0.2,
                    batch_max_attempts=1)


@pytest.fixture
def lease_parts(settings: Settings, redis_client: Any) -> Iterator[tuple[Ledger, LoopThread, LiveLedger]]:
    loop = LoopThread()
    loop.start()

    async def connect() -> LiveLedger:
        return LiveLedger.connect(settings, keys.worker_client(WORKER))

    live = loop.run(connect())
    try:
        yield Ledger(redis_client), loop, live
    finally:
        loop.run(live.aclose())
        loop.stop()


def acquire(parts: tuple[Ledger, LoopThread, LiveLedger], settings: Settings) -> Lease:
    ledger, loop, live = parts
    lease = Lease.acquire(ledger, loop, live, settings, WORKER, JOB, BATCH, lambda *_: None)
    assert lease is not None
    return lease


def test_a_finished_run_gives_its_lease_and_attempt_back_once(
        lease_parts: Any, settings: Settings, redis_client: Any) -> None:
    ledger = lease_parts[0]
    lease = acquire(lease_parts, settings)
    assert lease.attempt == 1 and ledger.leases.token(JOB, BATCH) == lease.token
    _, loop, live = lease_parts
    assert Lease.acquire(ledger, loop, live, settings, WORKER, JOB, BATCH,
                         lambda *_: None) is None  # held: no second run takes it
    end = lease.end("done")
    assert (end.status, end.spent) == ("done", False)
    assert ledger.leases.attempts(JOB, BATCH) == 0 and not ledger.leases.alive(JOB, BATCH)
    assert lease.end(RuntimeError("late")) is end  # ended once: the second call changes nothing
    assert ledger.leases.attempts(JOB, BATCH) == 0 and ledger.leases.last_cause(JOB, BATCH) == ""


def test_an_error_nobody_planned_for_spends_the_attempt_and_keeps_its_cause(
        lease_parts: Any, settings: Settings) -> None:
    ledger = lease_parts[0]
    end = acquire(lease_parts, settings).end(RuntimeError("boom"))
    assert (end.status, end.spent, end.handled) == ("error", True, False)
    assert ledger.leases.attempts(JOB, BATCH) == 1
    assert ledger.leases.last_cause(JOB, BATCH) == f"{WORKER}: RuntimeError: boom"


def test_a_server_down_hands_the_batch_back_spending_nothing(
        lease_parts: Any, settings: Settings) -> None:
    end = acquire(lease_parts, settings).end(ServerDownError("gone"))
    assert (end.status, end.spent, end.handled) == ("handed-back", False, False)
    assert lease_parts[0].leases.attempts(JOB, BATCH) == 0


def test_a_lease_lost_to_another_copy_gives_its_attempt_back_by_hand_once(
        lease_parts: Any, settings: Settings, redis_client: Any) -> None:
    ledger = lease_parts[0]
    lease = acquire(lease_parts, settings)
    redis_client.delete(keys.lease(JOB, BATCH))  # lapsed in an outage; another copy took it
    assert ledger.leases.acquire(JOB, BATCH, "w1@other/t", ttl_s=30) == 2
    end = lease.end(LeaseLostError("taken over"))
    assert (end.status, end.lease_lost, end.handled) == ("stopped", True, True)
    assert lease.end(LeaseLostError("again")) is end
    assert ledger.leases.attempts(JOB, BATCH) == 1  # refunded once
    assert ledger.leases.token(JOB, BATCH) == "w1@other/t"  # the other copy's lease untouched


def test_over_the_limit_a_late_refund_is_waited_for_and_without_one_the_count_stands(
        lease_parts: Any, settings: Settings, redis_client: Any) -> None:
    ledger = lease_parts[0]
    redis_client.hincrby(keys.job_part(JOB, "attempts"), BATCH, 1)  # a copy that lost its lease
    lease = acquire(lease_parts, settings)
    assert lease.attempt == 2
    refund = threading.Timer(0.3, ledger.leases.refund, (JOB, BATCH))
    refund.start()
    assert lease.settled_attempts() == 1  # its refund landed within a lease period
    refund.join()
    redis_client.hincrby(keys.job_part(JOB, "attempts"), BATCH, 1)
    assert lease.settled_attempts() == 2  # none came: the batch is over its limit
    lease.end("done")

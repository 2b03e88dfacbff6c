"""The reconciler's re-dispatch rules (workers/reconciler.py), one round at a time, on a real
Valkey and the workers' Celery app, with no worker running: what it sends again, and what it
must leave alone because a live worker or a waiting message still has it."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
import redis

from fleetgen import broker, keys
from fleetgen.dispatch import dispatch
from fleetgen.ledger import STATE_PAUSED, Ledger
from fleetgen.settings import Settings
from tests.stack import make_job, queue_depth
from workers.reconciler import Reconciler

JOB = "rec"
B1, B2, B3 = keys.batch_id(1), keys.batch_id(2), keys.batch_id(3)
GRACE_S = 60.0


@pytest.fixture
def ledger(redis_client: Any, tmp_path: Path) -> Ledger:
    ledger = Ledger(redis_client)
    make_job(ledger, JOB, str(tmp_path / "out"), prompts=30, batch_size=10)
    return ledger


@pytest.fixture
def reconciler(celery_app: Any, redis_url: str) -> Iterator[Reconciler]:
    settings = Settings(redis_url=redis_url, lease_ttl_s=30, lease_renew_s=5,
                        lost_message_grace_s=GRACE_S)
    rec = Reconciler(celery_app, settings, "test")
    yield rec
    rec.ledger.r.close()


def only(batch: str, ledger: Ledger) -> None:
    """Every batch of the job but `batch` is done, so no other rule fires."""
    for b in (B1, B2, B3):
        if b != batch:
            ledger.batches.finish_and_settle(JOB, b, {}, "w0", [])


def started_ago(ledger: Ledger, batch: str, seconds: float) -> None:
    ledger.r.zadd(keys.job_part(JOB, "running"), {batch: time.time() - seconds})


def waiting(ledger: Ledger) -> set[tuple[str, str]]:
    return broker.waiting_batches(ledger.r, grace_s=GRACE_S)


def register(ledger: Ledger, worker: str) -> None:
    """A worker in the registry (its Redis connections carry its name)."""
    ledger.r.hset(keys.WORKERS, worker, orjson.dumps({"server": "http://127.0.0.1:1"}))


def test_a_running_batch_whose_lease_expired_is_sent_again_first(
        ledger: Ledger, reconciler: Reconciler) -> None:
    only(B1, ledger)
    ledger.leases.acquire(JOB, B1, "w0@a/t1", ttl_s=30)
    ledger.r.delete(keys.lease(JOB, B1))  # its worker died; the lease ran out
    started_ago(ledger, B1, 60)
    assert reconciler.reconcile_once()["dead_owner"] == 1
    assert set(ledger.batches.queued(JOB)) == {B1} and ledger.batches.running(JOB) == {}
    assert waiting(ledger) == {(JOB, B1)}
    assert ledger.r.llen(keys.SHARED_QUEUE) == 1  # the top priority list: before fresh work
    assert "lease expired" in ledger.leases.last_cause(JOB, B1)
    assert ledger.leases.attempts(JOB, B1) == 1  # the dead worker's attempt stays spent


def test_a_batch_leased_a_moment_ago_is_not_taken_for_a_dead_one(
        ledger: Ledger, reconciler: Reconciler) -> None:
    # `acquire` sets the lease before `running`: a batch in `running` without a lease for
    # less than a renewal period may be a lease just taken, so it waits for the next round.
    only(B1, ledger)
    started_ago(ledger, B1, 1)
    assert sum(reconciler.reconcile_once().values()) == 0
    assert waiting(ledger) == set() and set(ledger.batches.running(JOB)) == {B1}


def test_a_lease_whose_worker_closed_every_connection_is_broken_on_the_second_round(
        ledger: Ledger, reconciler: Reconciler, redis_server: Any) -> None:
    only(B1, ledger)
    register(ledger, "w0@gone")
    ledger.leases.acquire(JOB, B1, "w0@gone/t1", ttl_s=30)
    started_ago(ledger, B1, 60)
    # One round without a connection may be a reconnect in progress: nothing yet.
    assert reconciler.reconcile_once()["gone_owner"] == 0
    assert ledger.leases.alive(JOB, B1)
    assert reconciler.reconcile_once()["gone_owner"] == 1
    assert not ledger.leases.alive(JOB, B1)
    assert waiting(ledger) == {(JOB, B1)}
    assert "process is gone" in ledger.leases.last_cause(JOB, B1)


def test_a_lease_of_a_connected_worker_or_of_one_that_names_no_connection_is_left_alone(
        ledger: Ledger, reconciler: Reconciler, redis_server: Any) -> None:
    register(ledger, "w0@alive")
    ledger.leases.acquire(JOB, B1, "w0@alive/t1", ttl_s=30)
    ledger.leases.acquire(JOB, B2, "w1@old/t2", ttl_s=30)  # an older worker: not in the registry
    ledger.batches.finish_and_settle(JOB, B3, {}, "w0", [])
    started_ago(ledger, B1, 60)
    started_ago(ledger, B2, 60)
    alive = redis.Redis(host="127.0.0.1", port=redis_server.port, password=redis_server.password,
                        client_name=keys.worker_client("w0@alive"))
    try:
        alive.ping()
        for _ in range(3):
            assert sum(reconciler.reconcile_once().values()) == 0
    finally:
        alive.close()
    assert ledger.leases.token(JOB, B1) == "w0@alive/t1" and ledger.leases.alive(JOB, B2)
    assert waiting(ledger) == set()


def test_a_queued_batch_whose_message_was_lost_is_sent_again_after_the_grace(
        ledger: Ledger, reconciler: Reconciler) -> None:
    only(B1, ledger)
    ledger.batches.mark_queued_and_settle(JOB, [B1])  # e.g. a BRPOP in flight when Redis restarted
    assert reconciler.reconcile_once()["lost_message"] == 0  # within the grace
    ledger.r.zadd(keys.job_part(JOB, "queued"), {B1: time.time() - GRACE_S - 1})
    assert reconciler.reconcile_once()["lost_message"] == 1
    assert waiting(ledger) == {(JOB, B1)}
    assert time.time() - ledger.batches.queued(JOB)[B1] < GRACE_S


def test_a_queued_batch_still_waiting_in_the_broker_is_not_sent_twice(
        ledger: Ledger, reconciler: Reconciler, celery_app: Any) -> None:
    only(B1, ledger)
    dispatch(celery_app, ledger, JOB, [B1], keys.SHARED_QUEUE)
    ledger.r.zadd(keys.job_part(JOB, "queued"), {B1: time.time() - GRACE_S - 1})
    assert reconciler.reconcile_once()["lost_message"] == 0
    assert queue_depth(ledger.r, keys.SHARED_QUEUE) == 1
    # Its wait starts again, so a long queue is not re-read every round.
    assert time.time() - ledger.batches.queued(JOB)[B1] < GRACE_S


def test_a_batch_in_no_state_is_sent_again_once_two_rounds_agree(
        ledger: Ledger, reconciler: Reconciler) -> None:
    only(B2, ledger)  # B2 is neither queued, running nor done: a restart lost its last write
    assert reconciler.reconcile_once()["no_state"] == 0
    assert reconciler.reconcile_once()["no_state"] == 1
    assert waiting(ledger) == {(JOB, B2)} and set(ledger.batches.queued(JOB)) == {B2}


def test_a_job_that_is_not_running_is_left_alone(ledger: Ledger, reconciler: Reconciler) -> None:
    ledger.jobs.set_state(JOB, STATE_PAUSED, "operator")
    ledger.leases.acquire(JOB, B1, "w0@a/t1", ttl_s=30)
    ledger.r.delete(keys.lease(JOB, B1))
    started_ago(ledger, B1, 60)
    for _ in range(2):
        assert sum(reconciler.reconcile_once().values()) == 0
    assert waiting(ledger) == set()


def test_a_redis_outage_is_one_line_when_it_goes_and_one_when_it_is_back(
        celery_app: Any, redis_url: str, caplog: pytest.LogCaptureFixture) -> None:
    from fleetgen.ports import free_port

    settings = Settings(redis_url=f"redis://127.0.0.1:{free_port()}/0", reconcile_interval_s=0.02)
    rec = Reconciler(celery_app, settings, "test")
    rounds = []
    real = rec._take_turn

    def counted() -> bool:
        rounds.append(1)
        if len(rounds) == 6:  # Redis comes back: point the ledger at the real one
            rec.ledger = Ledger(redis.Redis.from_url(redis_url))
        return real()

    rec._take_turn = counted  # type: ignore[method-assign]
    with caplog.at_level("WARNING", logger="workers.reconciler"):
        rec.start()
        deadline = time.monotonic() + 60
        while len(rounds) < 8 and time.monotonic() < deadline:
            time.sleep(0.02)
        rec.stop()
    lines = [r.getMessage() for r in caplog.records]
    assert len(rounds) >= 8
    assert sum("Redis unreachable" in line for line in lines) == 1, lines
    assert sum("Redis is back" in line for line in lines) == 1, lines
    assert not any(r.exc_info for r in caplog.records)

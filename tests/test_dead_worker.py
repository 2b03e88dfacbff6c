"""A SIGKILLed worker's batches come back as soon as its Redis connections are gone, not when
its leases expire (real Valkey, simulator and Celery workers)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import orjson
import pytest

from launcher.embedded import wait_until
from tests.stack import Stack, chat_rows, wait_job_done, write_jsonl
from workers import keys
from workers.ledger import Ledger

pytestmark = pytest.mark.e2e

# Leases long enough that only the connection signal can explain a quick re-dispatch.
LONG_LEASES = {"FLEETGEN_LEASE_TTL_S": "120", "FLEETGEN_LEASE_RENEW_S": "1",
               "FLEETGEN_RECONCILE_INTERVAL_S": "1"}


def owners(ledger: Ledger, job: str) -> dict[str, str]:
    """batch -> worker holding its lease, for the job's running batches."""
    out = {}
    for batch in ledger.running_batches(job):
        token = ledger.lease_token(job, batch)
        if token:
            out[batch] = keys.lease_owner(token)
    return out


def test_a_killed_workers_batches_are_back_in_seconds_with_leases_of_two_minutes(
    stack: Stack, tmp_path: Path, redis_client: Any,
) -> None:
    ledger = Ledger(redis_client)
    rows = chat_rows(80)
    # About 6 s per batch of 20: the batch is still running when its worker dies.
    slow = ("--max-running-requests", "4", "--decode-tps", "80", "--mean-output-tokens", "1000",
            "--speed", "10")
    _, url0 = stack.sim("sim0", *slow)
    _, url1 = stack.sim("sim1", *slow)
    victim = stack.worker(0, url0, LONG_LEASES)
    src = write_jsonl(tmp_path / "p.jsonl", rows)
    stack.producer("enqueue", str(src), "--job", "gone", "--output", str(tmp_path / "out"),
                   "--batch-size", "20")
    wait_until(lambda: "gpu0@test" in owners(ledger, "gone").values(), 60,
               what="gpu0 holding a batch")
    entry = orjson.loads(redis_client.hget(keys.WORKERS, "gpu0@test"))
    assert entry["named_connections"] is True
    stack.worker(1, url1, LONG_LEASES)

    at_kill = owners(ledger, "gone")
    batch = next(b for b, w in at_kill.items() if w == "gpu0@test")
    victim.kill()
    killed = time.monotonic()
    assert not ledger.is_done("gone", batch)
    wait_until(lambda: owners(ledger, "gone").get(batch) == "gpu1@test"
               or ledger.is_done("gone", batch), 60, what=f"{batch} running again on gpu1")
    # Two reconciler rounds of 1 s confirm the connections are gone; the lease had 2 minutes.
    assert time.monotonic() - killed < 30
    assert int(redis_client.hget(keys.job_part("gone", "attempts"), batch)) == 2
    status = wait_job_done(stack, "gone", timeout=180)
    assert (status["done"], status["failed"]) == (80, 0)
    assert "closed every Redis connection" in stack.logs()
    # No live worker lost a lease to the signal: only the victim's batches ran twice.
    attempts = {k.decode(): int(v) for k, v in
                redis_client.hgetall(keys.job_part("gone", "attempts")).items()}
    assert {b for b, n in attempts.items() if n > 1} <= {
        b for b, w in at_kill.items() if w == "gpu0@test"}

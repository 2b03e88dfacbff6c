"""When a worker goes away, its batches are back in work at once (real Valkey, simulators and
Celery workers): a SIGKILLed worker's as soon as its Redis connections are gone (not when its
leases expire); a SIGTERMed worker's as soon as its requests at the server have finished.

Neither test times anything: a lease longer than the wait proves the first, answers counted
around the signal prove the second. The seconds are figures of `python -m tests.perf`."""

from __future__ import annotations

import re
import signal
from pathlib import Path
from typing import Any

import orjson
import pytest

from fleetgen import keys
from fleetgen.ledger import Ledger
from fleetgen.poll import wait_until
from tests.stack import Stack, chat_rows, wait_job_done, write_jsonl

pytestmark = pytest.mark.e2e

# Leases far longer than any wait below: only the connection signal can explain a re-dispatch.
LONG_LEASES = {"FLEETGEN_LEASE_TTL_S": "600", "FLEETGEN_LEASE_RENEW_S": "1",
               "FLEETGEN_RECONCILE_INTERVAL_S": "1"}
SLOTS = 4
# 1,000-token answers at 800 tok/s (1.25 s each), 4 at a time.
SLOW = ("--max-running-requests", str(SLOTS), "--decode-tps", "80", "--mean-output-tokens", "1000",
        "--speed", "10")


def two_servers(stack: Stack, *flags: str) -> tuple[str, str]:
    return stack.sim("sim0", *SLOW, *flags)[1], stack.sim("sim1", *SLOW, *flags)[1]


def owners(ledger: Ledger, job: str) -> dict[str, str]:
    """batch -> worker holding its lease, for the job's running batches."""
    out = {}
    for batch in ledger.batches.running(job):
        token = ledger.leases.token(job, batch)
        if token:
            out[batch] = keys.lease_owner(token)
    return out


def answered(redis_client: Any, job: str) -> int:
    """Answers checkpointed so far over the job's unfinished batches."""
    return sum(int(redis_client.hlen(key))
               for key in redis_client.scan_iter(match=keys.checkpoint(job, "*")))


def test_a_killed_workers_batches_are_back_before_their_ten_minute_leases_could_expire(
    stack: Stack, tmp_path: Path, redis_client: Any,
) -> None:
    ledger = Ledger(redis_client)
    rows = chat_rows(80)
    # About 6 s per batch of 20: the batch is still running when its worker dies.
    url0, url1 = two_servers(stack)
    victim = stack.worker(0, url0, LONG_LEASES)
    src = write_jsonl(tmp_path / "p.jsonl", rows)
    stack.producer("enqueue", str(src), "--job", "gone", "--output", str(tmp_path / "out"),
                   "--batch-size", "20")
    wait_until(lambda: "gpu0@test" in owners(ledger, "gone").values(), 60,
               what="gpu0 holding a batch")
    assert redis_client.hexists(keys.WORKERS, "gpu0@test")
    stack.worker(1, url1, LONG_LEASES)

    at_kill = owners(ledger, "gone")
    batch = next(b for b, w in at_kill.items() if w == "gpu0@test")
    victim.kill()
    assert not ledger.batches.is_done("gone", batch)
    # Two reconciler rounds of 1 s confirm the connections are gone; the lease has 10 minutes,
    # five times this wait, so a batch back within it was not waiting for the lease.
    wait_until(lambda: owners(ledger, "gone").get(batch) == "gpu1@test"
               or ledger.batches.is_done("gone", batch), 120, what=f"{batch} running again on gpu1")
    assert int(redis_client.hget(keys.job_part("gone", "attempts"), batch)) == 2
    status = wait_job_done(stack, "gone", timeout=180)
    assert (status.done, status.failed) == (80, 0)
    assert "closed every Redis connection" in stack.logs()
    # No live worker lost a lease to the signal: only the victim's batches ran twice.
    attempts = {k.decode(): int(v) for k, v in
                redis_client.hgetall(keys.job_part("gone", "attempts")).items()}
    assert {b for b, n in attempts.items() if n > 1} <= {
        b for b, w in at_kill.items() if w == "gpu0@test"}


def test_sigterm_hands_batches_back_after_the_requests_at_the_server_not_the_whole_batch(
    stack: Stack, tmp_path: Path, redis_client: Any,
) -> None:
    ledger = Ledger(redis_client)
    rows = chat_rows(80)
    # Every answer takes exactly 1.25 s: a batch of 40 on 4 slots takes 12.5 s, its requests
    # at the server at most 1.25 s more.
    url0, url1 = two_servers(stack, "--output-sigma", "0")
    leaving = stack.worker(0, url0)
    src = write_jsonl(tmp_path / "p.jsonl", rows)
    stack.producer("enqueue", str(src), "--job", "term", "--output", str(tmp_path / "out"),
                   "--batch-size", "40")
    wait_until(lambda: any(w == "gpu0@test" and redis_client.hlen(keys.checkpoint("term", b)) >= 4
                           for b, w in owners(ledger, "term").items()), 60,
               what="gpu0 a few answers into a batch")
    batch = next(b for b, w in owners(ledger, "term").items() if w == "gpu0@test")
    in_flight_limit = int(orjson.loads(redis_client.hget(keys.WORKERS, "gpu0@test"))["limit"])
    assert leaving.popen is not None
    before = answered(redis_client, "term")
    leaving.popen.send_signal(signal.SIGTERM)
    leaving.popen.wait(120)
    # After the signal it finishes what is at the server (at most its in-flight limit; plus one
    # round of the 4 slots that may land between the count and the signal), not the batch.
    after = answered(redis_client, "term")
    assert after - before <= in_flight_limit + SLOTS, (before, after, in_flight_limit)
    said = re.findall(rf"term/{batch} handed back with (\d+) prompts unsent", stack.logs())
    assert len(set(said)) == 1, said  # one hand-back (the task's log repeats the line)
    unsent = int(said[0])
    assert unsent > 0
    assert not ledger.batches.is_done("term", batch) and not ledger.leases.alive("term", batch)
    # The hand-back spent no attempt: the next worker's run is attempt 1 again.
    assert int(redis_client.hget(keys.job_part("term", "attempts"), batch)) == 0

    stack.worker(1, url1)
    status = wait_job_done(stack, "term", timeout=180)
    assert (status.done, status.failed) == (80, 0)
    # gpu0 started it from scratch; gpu1 resumed it from the checkpoint, still attempt 1.
    runs = re.findall(rf"batch term/{batch}: \d+ prompts \((\d+) resumed\), attempt 1",
                      stack.logs())
    assert len(runs) == 2 and int(runs[0]) == 0 and int(runs[1]) >= 4
    # Every request gpu0 had sent was answered and kept: gpu1 sent only the unsent ones.
    assert int(runs[1]) == 40 - unsent

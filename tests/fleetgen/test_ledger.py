"""The ledger's scripts on a real Valkey, without workers: leases, attempts, refunds, a batch
recorded once, and a prompt counted once (fleetgen/ledger/, fleetgen/checkpoints.py).

These are the invariants the end-to-end tests rely on ("every prompt exactly once, and status
tells the truth"), each checked directly in milliseconds. And the ledger's client is its own:
no product module outside fleetgen/ledger/ and fleetgen/liveledger.py reaches `ledger.r`.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import orjson
import pytest

from fleetgen import keys
from fleetgen.checkpoints import RECORD_GROUP, Entry, group_arguments
from fleetgen.ledger import Ledger

JOB = "led"

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("fleetgen", "workers", "producer", "launcher")
# The modules that own the ledger's client; everyone else calls their parts' methods.
CLIENT_OWNERS = (ROOT / "fleetgen" / "ledger", ROOT / "fleetgen" / "liveledger.py")


def floats(r: Any, key: str) -> dict[str, float]:
    return {k.decode(): float(v) for k, v in r.hgetall(key).items()}


def running(ledger: Ledger) -> set[str]:
    return set(ledger.batches.running(JOB))


def test_a_lease_is_held_by_one_worker_and_each_take_spends_an_attempt(ledger: Ledger) -> None:
    assert ledger.leases.acquire(JOB, "b1", "w0/a", ttl_s=30) == 1
    assert ledger.leases.acquire(JOB, "b1", "w1/b", ttl_s=30) is None  # held: nobody else takes it
    assert ledger.leases.token(JOB, "b1") == "w0/a"
    assert running(ledger) == {"b1"}
    assert ledger.leases.release(JOB, "b1", "w0/a", refund=False)
    assert ledger.leases.acquire(JOB, "b1", "w1/b", ttl_s=30) == 2
    assert ledger.leases.attempts(JOB, "b1") == 2


def test_a_refused_take_counts_no_attempt_and_leaves_the_batch_where_it_was(
        ledger: Ledger) -> None:
    ledger.batches.mark_queued_and_settle(JOB, ["b1", "b2"])
    ledger.leases.acquire(JOB, "b1", "w0/a", ttl_s=30)
    ledger.batches.mark_queued_and_settle(JOB, ["b1"])  # a duplicate delivery's dispatch
    assert ledger.leases.acquire(JOB, "b1", "w1/b", ttl_s=30) is None
    assert ledger.leases.attempts(JOB, "b1") == 1
    assert set(ledger.batches.queued(JOB)) == {"b1", "b2"}
    assert ledger.r.pttl(keys.lease(JOB, "b1")) > 29_000  # the holder's lease, untouched


def test_the_lease_holders_of_many_batches_are_read_together(ledger: Ledger) -> None:
    ledger.leases.acquire(JOB, "b1", "w0/a", ttl_s=30)
    ledger.leases.acquire(JOB, "b2", "w1/b", ttl_s=30)
    ledger.leases.release(JOB, "b2", "w1/b", refund=True)
    assert ledger.leases.tokens(JOB, ["b1", "b2", "b3"]) == {"b1": "w0/a", "b2": None, "b3": None}
    assert ledger.leases.tokens(JOB, []) == {}


def test_a_refunded_release_gives_the_attempt_back_and_leaves_running(ledger: Ledger) -> None:
    ledger.batches.mark_queued_and_settle(JOB, ["b1"])
    ledger.leases.acquire(JOB, "b1", "w0/a", ttl_s=30)
    assert set(ledger.batches.queued(JOB)) == set()  # taking it moves it to running
    assert ledger.leases.release(JOB, "b1", "w0/a", refund=True)
    assert ledger.leases.attempts(JOB, "b1") == 0
    assert running(ledger) == set()
    assert not ledger.leases.alive(JOB, "b1")


def test_a_release_by_a_token_that_lost_the_lease_changes_nothing(ledger: Ledger) -> None:
    ledger.leases.acquire(JOB, "b1", "w0/a", ttl_s=30)
    ledger.r.delete(keys.lease(JOB, "b1"))  # expired
    assert ledger.leases.acquire(JOB, "b1", "w1/b", ttl_s=30) == 2  # taken over
    assert not ledger.leases.release(JOB, "b1", "w0/a", refund=True)
    assert not ledger.leases.release(JOB, "b1", "w0/a", refund=False)
    # The new holder keeps its lease, its place in `running` and both attempts.
    assert ledger.leases.token(JOB, "b1") == "w1/b"
    assert running(ledger) == {"b1"}
    assert ledger.leases.attempts(JOB, "b1") == 2


def test_a_broken_lease_keeps_its_attempt_spent_and_refund_gives_one_back(ledger: Ledger) -> None:
    ledger.leases.acquire(JOB, "b1", "w0/a", ttl_s=30)
    assert ledger.leases.release(JOB, "b1", "w0/a", refund=False)
    assert ledger.leases.attempts(JOB, "b1") == 1 and not ledger.leases.alive(JOB, "b1")
    ledger.leases.refund(JOB, "b1")  # a worker that noticed it lost the lease
    assert ledger.leases.attempts(JOB, "b1") == 0


def test_a_batch_is_recorded_once_however_often_it_is_finished(ledger: Ledger) -> None:
    r = ledger.r
    ledger.batches.mark_queued_and_settle(JOB, ["b1"])
    ledger.leases.acquire(JOB, "b1", "w0/a", ttl_s=30)
    r.hset(keys.checkpoint(JOB, "b1"), "p1", b"{}")
    counts = {"prompts_done": 9.0, "prompts_failed": 1.0}
    failure = [orjson.dumps({"batch": "b1", "code": "x", "id": "p2"})]
    assert ledger.batches.finish_and_settle(JOB, "b1", counts, "w0", failure, bytes_written=100,
                                            now=5.0)
    # A late duplicate, or a re-count after a crash between the write and the first call.
    ledger.batches.mark_queued_and_settle(JOB, ["b1"])
    assert not ledger.batches.finish_and_settle(JOB, "b1", counts, "w1", failure, bytes_written=100)
    assert floats(r, keys.job_part(JOB, "written")) == counts
    stats = floats(r, keys.job_part(JOB, "stats"))
    assert stats == {"batches_done": 1.0, "bytes_written": 100.0}
    assert floats(r, keys.job_part(JOB, "workers")) == {"w0|batches_done": 1.0}
    assert r.llen(keys.job_part(JOB, "failures")) == 1
    assert float(r.hget(keys.job(JOB), "last_write_at")) == 5.0
    # Either call leaves the batch only in `done`, its checkpoint dropped.
    assert ledger.batches.done(JOB) == {"b1"}
    assert running(ledger) == set() and ledger.batches.queued(JOB) == {}
    assert not r.exists(keys.checkpoint(JOB, "b1"))


def test_finish_keeps_only_the_latest_failure_reasons(ledger: Ledger,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    reasons = [orjson.dumps({"batch": "b1", "id": f"p{i}"}) for i in range(5)]
    monkeypatch.setattr("fleetgen.ledger._batches.FAILURES_KEPT", 3)
    ledger.batches.finish_and_settle(JOB, "b1", {"prompts_failed": 5.0}, "w0", reasons)
    kept = [orjson.loads(x)["id"] for x in ledger.r.lrange(keys.job_part(JOB, "failures"), 0, -1)]
    assert kept == ["p4", "p3", "p2"]


def entry(prompt: str, batch: str = "b1", **counters: float) -> Entry:
    return Entry(JOB, batch, prompt, orjson.dumps({"id": prompt}),
                 counters or {"prompts_done": 1, "output_tokens": 10}, b"[]")


def test_a_batchs_answers_that_skipped_the_checkpoint_are_counted_by_its_first_recording_only(
        ledger: Ledger) -> None:
    r = ledger.r
    live = {"prompts_done": 9.0, "input_tokens": 270.0, "embeddings": 9.0, "output_tokens": 4.0}
    written = {"prompts_done": 9.0, "prompts_failed": 0.0}
    assert ledger.batches.finish_and_settle(JOB, "b1", written, "w0", [], now=60 * 7 + 1,
                                            live=live)
    assert not ledger.batches.finish_and_settle(JOB, "b1", written, "w1", [], now=60 * 8,
                                                live=live)
    stats = floats(r, keys.job_part(JOB, "stats"))
    assert stats == {**live, "batches_done": 1.0, "bytes_written": 0.0}
    assert floats(r, keys.job_part(JOB, "workers")) == {
        "w0|batches_done": 1.0, "w0|prompts_done": 9.0, "w0|output_tokens": 4.0}
    assert floats(r, keys.job_part(JOB, "minutes")) == {"7": 9.0, "7|tokens": 4.0}
    assert floats(r, keys.job_part(JOB, "worker_minutes")) == {
        "w0|7|prompts": 9.0, "w0|7|tokens": 4.0}
    # Rebuilt from the sink (no worker): the counters and the minutes, no worker's tallies.
    assert ledger.batches.finish_and_settle(JOB, "b2", written, "", [], now=60 * 9,
                                            live={"prompts_done": 2.0})
    assert floats(r, keys.job_part(JOB, "stats"))["prompts_done"] == 11.0
    assert floats(r, keys.job_part(JOB, "minutes"))["9"] == 2.0
    assert set(floats(r, keys.job_part(JOB, "workers"))) == {
        "w0|batches_done", "w0|prompts_done", "w0|output_tokens"}


def record_group(r: Any, entries: list[Entry], worker: str = "w0", window: int = 0) -> list[int]:
    script_keys, args = group_arguments(JOB, entries, worker, minute=7, window=window)
    return [int(x) for x in r.register_script(RECORD_GROUP)(keys=script_keys, args=args)]


def test_a_prompt_is_counted_once_even_twice_in_one_group_or_again_later(redis_client: Any) -> None:
    r = redis_client
    reply = record_group(r, [entry("p1"), entry("p2", batch="b2"), entry("p1")])
    assert reply == [-1, 1, 1, 0]  # no canary; p1's second copy is not a first copy
    assert record_group(r, [entry("p2", batch="b2"), entry("p3")], worker="w1") == [-1, 0, 1]
    assert floats(r, keys.job_part(JOB, "stats")) == {"prompts_done": 3.0, "output_tokens": 30.0}
    assert r.hlen(keys.checkpoint(JOB, "b1")) == 2 and r.hlen(keys.checkpoint(JOB, "b2")) == 1
    assert floats(r, keys.job_part(JOB, "workers")) == {
        "w0|prompts_done": 2.0, "w0|output_tokens": 20.0,
        "w1|prompts_done": 1.0, "w1|output_tokens": 10.0}
    assert floats(r, keys.job_part(JOB, "minutes")) == {"7": 3.0, "7|tokens": 30.0}


def test_a_first_copy_keeps_its_record_and_counters_and_feeds_the_canary_once(
        redis_client: Any) -> None:
    r = redis_client
    first = entry("p1", prompts_failed=1, error_context_length_exceeded=1)
    assert record_group(r, [first], window=2) == [1, 1]
    # A re-run's answer for the same prompt: neither its record nor its counters land.
    assert record_group(r, [entry("p1"), entry("p2"), entry("p3")], window=2) == [3, 0, 1, 1]
    assert orjson.loads(r.hget(keys.checkpoint(JOB, "b1"), "p1")) == {"id": "p1"}
    stats = floats(r, keys.job_part(JOB, "stats"))
    assert stats == {"prompts_failed": 1.0, "error_context_length_exceeded": 1.0,
                     "prompts_done": 2.0, "output_tokens": 20.0}
    assert r.llen(keys.job_part(JOB, "recent")) == 2  # the canary's window


def client_uses(source: str) -> list[int]:
    """Lines of `source` that reach a ledger's Redis client: `.r` of a name or attribute that
    names a ledger (`ledger.r`, `self.ledger.r`, `self._live.r`, `live_ledger.r` ...)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Attribute) and node.attr == "r"):
            continue
        base = node.value
        name = (base.id if isinstance(base, ast.Name)
                else base.attr if isinstance(base, ast.Attribute) else "")
        if "ledger" in name.lower() or "live" in name.lower():
            found.append(node.lineno)
    return sorted(found)


def test_the_client_check_finds_a_ledgers_r_however_the_ledger_is_named() -> None:
    source = """
ledger.r.get('k')
broker.waiting_batches(self.ledger.r, grace_s=1)
CheckpointWriter(live.r, worker)
client = self._live.r
colour.r + point.r  # not a ledger
"""
    assert client_uses(source) == [2, 3, 4, 5]


def test_no_product_module_reaches_the_ledgers_client_outside_the_ledger() -> None:
    leaks = [f"{path.relative_to(ROOT)}:{line}"
             for package in PRODUCT for path in sorted((ROOT / package).rglob("*.py"))
             if not any(path == owner or owner in path.parents for owner in CLIENT_OWNERS)
             for line in client_uses(path.read_text())]
    assert leaks == [], "use a method of the ledger part that owns the keys (fleetgen/ledger/)"

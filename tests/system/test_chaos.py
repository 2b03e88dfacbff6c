"""Chaos: one job survives SIGKILLed workers, a kill -9 of Redis, a crashed server and an S3 outage.

Afterwards the export holds every input id exactly once; failures are only the prompts the
simulator was told to fail, with its reason; and every killed worker's batches were running
again, with no restart of anything (the lease + reconciler path, default timings). How soon
(the README's "within a minute") is a figure of `python -m tests.perf --only timings`: this
test only waits, long enough for a lease to expire and be reconciled on a loaded machine.
"""

from __future__ import annotations

import collections
import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from fleetgen import keys
from fleetgen.job import batch_sizes
from fleetgen.ledger import Ledger
from fleetgen.retry import REDIS_ERRORS
from launcher.services import RedisServer, S3Server
from tests.stack import Stack, chat_rows, wait_job_done, write_jsonl

pytestmark = [pytest.mark.e2e, pytest.mark.chaos]

PROMPTS = 2000
POISON = "POISON-PILL"
POISONED = {f"c{i:05d}" for i in range(0, PROMPTS, 397)}
SIM = ("--max-running-requests", "16", "--decode-tps", "80", "--mean-output-tokens", "400",
       "--speed", "6", "--fail-rate", "0.02", "--fail-prompt", POISON)
# Production lease timings (30 s TTL, 10 s reconcile): recovery is tested as shipped.
CHAOS_ENV = {
    "FLEETGEN_LEASE_TTL_S": "30", "FLEETGEN_LEASE_RENEW_S": "5",
    "FLEETGEN_RECONCILE_INTERVAL_S": "10", "FLEETGEN_LOST_MESSAGE_GRACE_S": "20",
}


@pytest.fixture
def chaos_stack(tmp_path: Path) -> Iterator[tuple[Stack, RedisServer, S3Server]]:
    redis_server = RedisServer(data_dir=tmp_path / "redis").start()
    s3_server = S3Server(data_dir=tmp_path / "s3").start()
    stack = Stack(tmp_path, {"REDIS_URL": redis_server.url, **s3_server.env()})
    try:
        yield stack, redis_server, s3_server
    finally:
        stack.close()
        s3_server.stop()
        redis_server.stop()


def _rows() -> list[dict[str, Any]]:
    rows = []
    for i, row in enumerate(chat_rows(PROMPTS, prefix="c")):
        pid = row.get("id") or row.get("custom_id")
        if pid in POISONED:
            row = {"id": pid, "prompt": f"This prompt carries the {POISON} and must fail ({i})."}
        rows.append(row)
    return rows


def _requests_at(url: str) -> int:
    """Requests a server is running or queueing, from its /metrics."""
    text = httpx.get(f"{url}/metrics", timeout=5).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith(("sglang:num_running_reqs", "sglang:num_queue_reqs")):
            total += float(line.rsplit(" ", 1)[1])
    return int(total)


class Recovery:
    """Measures, per killed worker, kill -> every batch it held running again elsewhere (or done)."""

    def __init__(self, redis_client: Any, job: str) -> None:
        self.r = redis_client
        self.job = job
        self.seconds: list[float] = []
        self.redone: list[int] = []
        self.unfinished: list[int] = []

    def held_by(self, worker: str) -> dict[str, int]:
        held = {}
        for key in self.r.scan_iter(match=f"{keys.PREFIX}:lease:{self.job}:*"):
            owner = self.r.get(key)
            if owner and owner.decode().startswith(f"{worker}/"):
                batch = key.decode().rsplit(":", 1)[1]
                held[batch] = int(self.r.hlen(keys.checkpoint(self.job, batch)))
        return held

    def wait_back(self, worker: str, held: dict[str, int], killed_at: float, limit: float) -> None:
        """Until every batch `worker` held runs elsewhere or is done; `limit` only stops waiting."""
        pending = set(held)
        while pending and time.monotonic() - killed_at < limit:
            for batch in list(pending):
                try:  # Redis itself may be down for a moment: chaos goes on meanwhile
                    owner = self.r.get(keys.lease(self.job, batch))
                    done = self.r.sismember(keys.job_part(self.job, "done"), batch)
                except REDIS_ERRORS:
                    continue
                back = owner is not None and not owner.decode().startswith(f"{worker}/")
                if back or done:
                    pending.discard(batch)
            time.sleep(0.2)
        self.seconds.append(time.monotonic() - killed_at)
        assert not pending, f"batches {pending} of {worker} not running again {limit:.0f}s after kill"


def test_a_job_survives_worker_redis_server_and_s3_failures(
    chaos_stack: tuple[Stack, RedisServer, S3Server], tmp_path: Path
) -> None:
    stack, redis_server, s3_server = chaos_stack
    rows = _rows()
    src = write_jsonl(tmp_path / "chaos.jsonl", rows)
    sims = [stack.sim(f"sim{i}", *SIM) for i in range(3)]
    workers = {i: stack.worker(i, sims[i][1], extra_env=CHAOS_ENV) for i in range(3)}
    stack.producer("enqueue", str(src), "--job", "chaos", "--output", f"s3://{s3_server.bucket}/runs",
                   "--batch-size", "25", "--max-tokens", "4000", "--no-canary")
    r = redis_server.client()
    manifest = Ledger(r).jobs.load("chaos")
    # The plan, not PROMPTS // 25: the job's end goes out in smaller batches (taper), and
    # workers finish batches out of order, so a batch count says nothing about the share done.
    plan = batch_sizes(manifest.prompts, manifest.batch_size, taper=manifest.taper)
    sizes = {keys.batch_id(i): n for i, n in enumerate(plan, start=1)}
    assert len(sizes) == manifest.batches
    recovery = Recovery(r, "chaos")
    rng = random.Random(7)
    errors: list[BaseException] = []
    steps: list[tuple[str, float]] = []  # what chaos did at which share done, for the reader

    def done_share() -> float:
        """Prompts answered or failed, live (each is counted as its checkpoint is written)."""
        try:
            stats = r.hmget(keys.job_part("chaos", "stats"), "prompts_done", "prompts_failed")
        except REDIS_ERRORS:
            return 0.0
        return sum(float(x or 0) for x in stats) / PROMPTS

    def job_over() -> bool:
        try:
            return int(r.scard(keys.job_part("chaos", "done"))) == manifest.batches
        except REDIS_ERRORS:
            return False

    def step(name: str) -> None:
        """Record a chaos step; it must come while the job still runs, or it tests nothing."""
        steps.append((name, round(done_share(), 3)))
        assert not job_over(), f"the job ended before {name}: {steps}"

    def wait_share(share: float) -> None:
        deadline = time.monotonic() + 300
        while done_share() < share and time.monotonic() < deadline:
            time.sleep(0.2)

    # Killed workers whose batches are being watched: (gpu, round, watcher). The chaos goes on
    # while they recover (tens of seconds with these timings), so its steps stay inside the job on a
    # loaded machine; each is replaced only once its batches run elsewhere (their recovery
    # needs no restart), and two live workers are kept to take the next victim's batches.
    recovering: list[tuple[int, int, threading.Thread]] = []

    def replace_the_recovered(keep_alive: int) -> None:
        for gpu, round_no, watcher in list(recovering):
            if watcher.is_alive() and len(workers) >= keep_alive:
                continue
            watcher.join()
            recovering.remove((gpu, round_no, watcher))
            workers[gpu] = stack.worker(gpu, sims[gpu][1], extra_env=CHAOS_ENV,
                                        name=f"gpu{gpu}r{round_no}")

    def kill_a_worker(round_no: int) -> None:
        replace_the_recovered(keep_alive=2)
        # A worker holding a batch now: one chosen beforehand may never get another near the end.
        holders = {}
        while not holders:
            assert not job_over(), f"the job ended before kill {round_no}: {steps}"
            holders = {gpu: held for gpu in sorted(workers)
                       if (held := recovery.held_by(workers[gpu].name + "@test"))}
            time.sleep(0 if holders else 0.1)
        gpu = rng.choice(sorted(holders))
        victim, held = workers.pop(gpu), holders[gpu]
        step(f"kill {round_no}")
        in_flight = _requests_at(sims[gpu][1])
        victim.kill()
        killed_at = time.monotonic()
        # Work redone: the requests the victim had at its server (its other unfinished prompts
        # were never sent, and finished ones are checkpointed).
        recovery.redone.append(in_flight)
        recovery.unfinished.append(sum(sizes[b] for b in held) - sum(held.values()))

        def watch() -> None:
            try:
                recovery.wait_back(victim.name + "@test", held, killed_at, limit=300)
            except BaseException as exc:  # noqa: BLE001 -- surfaced by the main thread below
                errors.append(exc)

        recovering.append((gpu, round_no, threading.Thread(target=watch, daemon=True)))
        recovering[-1][2].start()

    def chaos() -> None:
        try:
            wait_share(0.08)
            kill_a_worker(1)
            wait_share(0.25)
            step("redis kill -9")
            redis_server.kill()
            redis_server.restart()
            wait_share(0.35)
            kill_a_worker(2)
            wait_share(0.5)
            proc, url = sims[1]
            step("sim1 kill")
            proc.kill()
            time.sleep(2)
            port = int(url.rsplit(":", 1)[1])
            sims[1] = stack.sim("sim1b", *SIM, port=port)
            wait_share(0.6)
            # The last kill before the outage: the job goes on during it and may end soon after.
            kill_a_worker(3)
            wait_share(0.7)
            step("s3 stop")
            s3_server.stop()
            time.sleep(10)
            s3_server.start()
            steps.append(("over", round(done_share(), 3)))
            replace_the_recovered(keep_alive=3)
        except BaseException as exc:  # noqa: BLE001 -- surfaced by the main thread below
            errors.append(exc)
        finally:
            # Servers die with the thread that started them (PDEATHSIG): keep it until the end.
            chaos_over.set()
            test_over.wait(600)

    chaos_over, test_over = threading.Event(), threading.Event()
    thread = threading.Thread(target=chaos, daemon=True)
    thread.start()
    try:
        _finish_and_check(stack, rows, recovery, tmp_path, chaos_over, errors, steps)
        print(f"chaos steps at share done: {steps}")
    finally:
        test_over.set()
        thread.join(timeout=30)


def _finish_and_check(stack: Stack, rows: list[dict[str, Any]], recovery: Recovery, tmp_path: Path,
                      chaos_over: threading.Event, errors: list[BaseException],
                      steps: list[tuple[str, float]]) -> None:
    wait_job_done(stack, "chaos", timeout=600)
    assert chaos_over.wait(120), f"chaos did not finish: {steps}"
    assert not errors, (errors, steps)

    export = stack.producer("export", "chaos", "--to", str(tmp_path / "chaos-out.jsonl"))
    assert "missing 0" in export.stdout
    lines = [orjson.loads(x) for x in (tmp_path / "chaos-out.jsonl").read_bytes().splitlines()]
    ids = [x.get("id") if "custom_id" not in x else x["custom_id"] for x in lines]
    assert sorted(ids) == sorted(x.get("id") or x["custom_id"] for x in rows)
    assert max(collections.Counter(ids).values()) == 1
    failed = {x["custom_id"]: x for x in lines if "custom_id" in x}
    assert set(failed) == POISONED
    assert all(f["error"]["code"] == "context_length_exceeded" for f in failed.values())
    assert len(recovery.seconds) == 3
    print(f"\nchaos: redelivery seconds {[round(s, 1) for s in recovery.seconds]}, "
          f"requests in flight (re-sent) per kill {recovery.redone}, unfinished prompts of the "
          f"batches it held {recovery.unfinished}")

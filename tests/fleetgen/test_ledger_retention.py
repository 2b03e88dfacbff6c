"""Retention (Jobs.settle, fleetgen/ledger/settle_job.lua): a finished job (done or cancelled) leaves
the active jobs for the finished index, and its Redis keys expire FLEETGEN_JOB_RETENTION after
it finished; the reconciler, `producer jobs` and each worker's /metrics stop paying for it, so
none of them grows with every job ever run.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from fleetgen import keys
from fleetgen.ledger import (
    ACTIVE,
    FINISHED,
    GONE,
    STATE_CANCELLED,
    STATE_PAUSED,
    STATE_RUNNING,
    Jobs,
    Ledger,
)
from fleetgen.settings import JOB_RETENTION_S, Settings, SettingsError
from producer.cli import main
from tests.producer.test_status import Worker
from tests.sim_helpers import wait_until
from tests.stack import make_job
from workers import metrics
from workers.reconciler import FINISHED_GRACE_S, Reconciler

ROOT = Path(__file__).resolve().parents[2]
HOUR = 3600.0
SERVER = "http://127.0.0.1:30000"


@pytest.fixture
def settings(redis_url: str) -> Settings:
    return Settings(redis_url=redis_url, job_retention=HOUR)


@pytest.fixture
def ledger(redis_client: Any, settings: Settings) -> Iterator[Ledger]:
    """The shared `ledger`, with finished jobs' keys kept an hour (`settings`)."""
    ledger = Ledger.connect(settings)
    yield ledger
    ledger.r.close()


@pytest.fixture
def reconciler(celery_app: Any, settings: Settings) -> Iterator[Reconciler]:
    rec = Reconciler(celery_app, settings, "test")
    yield rec
    rec.ledger.r.close()


def job_with_answers(ledger: Ledger, name: str, output: str) -> Worker:
    """A job of 3 batches of 10: b000001 written, b000002 with 2 answers checkpointed."""
    make_job(ledger, name, output, prompts=30, batch_size=10)
    worker = Worker(ledger, "gpu0@a")
    minute = int(time.time() // 60)
    for _ in range(10):
        worker.answer(name, "b000001", minute)
    worker.fail(name, "b000001", minute)
    worker.finish_batch(name, "b000001", minute)
    ledger.batches.mark_queued_and_settle(name, ["b000002", "b000003"])
    ledger.leases.acquire(name, "b000002", "gpu0@a/t", ttl_s=30)
    worker.answer(name, "b000002", minute)
    worker.answer(name, "b000002", minute)
    return worker


def finish_all(ledger: Ledger, name: str) -> None:
    for batch in ledger.jobs.batches(name):
        ledger.batches.finish_and_settle(name, batch, {"prompts_done": 10}, "gpu0@a", [])


def job_keys_in_redis(ledger: Ledger, name: str) -> list[str]:
    """Every key of the job Redis holds, whatever its kind (leases aside: they expire anyway)."""
    found = set()
    for pattern in (f"fg:job:{name}", f"fg:job:{name}:*", f"fg:ckpt:{name}:*"):
        found |= {k.decode() for k in ledger.r.scan_iter(match=pattern)}
    return sorted(found)


def expiries(ledger: Ledger, name: str) -> dict[str, int]:
    """Key -> its expiry (unix ms; -1 when it has none)."""
    return {k: ledger.r.pexpiretime(k) for k in job_keys_in_redis(ledger, name)}


def test_a_done_job_leaves_the_active_jobs_and_all_its_keys_expire_after_the_retention(
        ledger: Ledger, tmp_path: Path) -> None:
    job_with_answers(ledger, "j", str(tmp_path))
    assert all(at == -1 for at in expiries(ledger, "j").values())
    assert ledger.jobs.active() == ["j"] and ledger.jobs.finished() == {}
    before = time.time()
    finish_all(ledger, "j")
    after = time.time()
    assert ledger.jobs.active() == []
    assert list(ledger.jobs.finished()) == ["j"] and ledger.jobs.names() == ["j"]
    found = expiries(ledger, "j")
    # Every part the workers wrote, the manifest's hash and the written counters included.
    assert {"fg:job:j", "fg:job:j:stats", "fg:job:j:minutes", "fg:job:j:written",
            "fg:job:j:done", "fg:job:j:workers", "fg:job:j:worker_minutes",
            "fg:job:j:attempts"} <= set(found)
    for key, at in found.items():
        assert (before + HOUR) * 1000 - 1 <= at <= (after + HOUR) * 1000 + 1, key
    # Idempotent: a late duplicate of the last batch, another round, the same expiry.
    ledger.batches.finish_and_settle("j", "b000003", {"prompts_done": 10}, "gpu0@b", [])
    assert ledger.jobs.settle("j") == FINISHED
    assert expiries(ledger, "j") == found


def test_a_cancelled_job_expires_with_its_checkpoints_and_resume_makes_it_last_again(
        ledger: Ledger, tmp_path: Path) -> None:
    job_with_answers(ledger, "j", str(tmp_path))
    ledger.jobs.set_state("j", STATE_CANCELLED, "cancelled by user")
    found = expiries(ledger, "j")
    assert keys.checkpoint("j", "b000002") in found
    assert all(at > 0 for at in found.values()) and ledger.jobs.active() == []
    ledger.jobs.set_state("j", STATE_RUNNING)
    assert all(at == -1 for at in expiries(ledger, "j").values())
    assert ledger.jobs.active() == ["j"] and ledger.jobs.finished() == {}


def test_a_paused_job_is_not_finished_even_with_every_batch_written(
        ledger: Ledger, tmp_path: Path) -> None:
    make_job(ledger, "j", str(tmp_path), prompts=20, batch_size=10)
    ledger.jobs.set_state("j", STATE_PAUSED, "paused by user")
    finish_all(ledger, "j")
    assert ledger.jobs.settle("j") == ACTIVE and ledger.jobs.active() == ["j"]
    assert all(at == -1 for at in expiries(ledger, "j").values())


def test_requeue_failed_of_a_done_job_makes_its_keys_last_until_it_is_done_again(
        ledger: Ledger, tmp_path: Path) -> None:
    make_job(ledger, "j", str(tmp_path), prompts=20, batch_size=10)
    finish_all(ledger, "j")
    first = ledger.jobs.finished()["j"]
    # What `requeue --failed` does: a round's batch, then queued (producer/control.py).
    ledger.r.sadd(keys.job_part("j", "extra"), "r01-000001")
    ledger.batches.mark_queued_and_settle("j", ["r01-000001"])
    assert ledger.jobs.active() == ["j"] and ledger.jobs.finished() == {}
    assert all(at == -1 for at in expiries(ledger, "j").values())
    ledger.batches.finish_and_settle("j", "r01-000001", {"prompts_done": 2}, "gpu0@a", [])
    assert ledger.jobs.finished()["j"] >= first  # finished again, its clock from now
    assert all(at > 0 for at in expiries(ledger, "j").values())


def test_a_job_rebuilt_after_its_keys_expired_gets_a_fresh_retention(
        ledger: Ledger, tmp_path: Path) -> None:
    make_job(ledger, "j", str(tmp_path), prompts=10, batch_size=10)
    long_ago = time.time() - 2 * HOUR
    finish_all(ledger, "j")
    ledger.r.zadd(keys.FINISHED_JOBS, {"j": long_ago})  # as if it had finished then ...
    for key in job_keys_in_redis(ledger, "j"):
        ledger.r.delete(key)  # ... and its keys had expired since
    make_job(ledger, "j", str(tmp_path), prompts=10, batch_size=10)  # a rebuild from the sink
    finish_all(ledger, "j")
    assert ledger.jobs.finished()["j"] > long_ago
    assert all(at > time.time() * 1000 for at in expiries(ledger, "j").values())


def test_with_a_one_second_retention_every_key_of_the_job_is_gone_and_jobs_no_longer_lists_it(
        redis_url: str, redis_client: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    short = Ledger.connect(Settings(redis_url=redis_url, job_retention=1))
    job_with_answers(short, "brief", str(tmp_path))
    make_job(short, "kept", str(tmp_path), prompts=10, batch_size=10)
    make_job(short, "live", str(tmp_path), prompts=10, batch_size=10)
    finish_all(short, "kept")
    for key in job_keys_in_redis(short, "kept"):
        short.r.persist(key)  # stands for a longer retention: still there
    finish_all(short, "brief")
    wait_until(lambda: not job_keys_in_redis(short, "brief"), what="the job's keys to expire")
    monkeypatch.setenv("REDIS_URL", redis_url)
    assert main(["jobs"]) == 0
    rows = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines()[1:]}
    assert set(rows) == {"live", "kept"}
    assert rows["live"][1] == "running" and rows["kept"][1:6] == ["done", "10", "0", "10", "100.0%"]
    assert "finished" in " ".join(rows["kept"])
    short.r.close()


def test_the_reconciler_walks_the_active_and_the_just_finished_jobs_only(
        ledger: Ledger, reconciler: Reconciler, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    now = time.time()
    for i in range(20):
        make_job(ledger, f"old{i:02d}", str(tmp_path), prompts=10, batch_size=10)
        finish_all(ledger, f"old{i:02d}")
        ledger.r.zadd(keys.FINISHED_JOBS, {f"old{i:02d}": now - FINISHED_GRACE_S - 60})
    make_job(ledger, "just", str(tmp_path), prompts=10, batch_size=10)
    finish_all(ledger, "just")
    make_job(ledger, "live", str(tmp_path), prompts=20, batch_size=10)
    # A job a ledger from before the finished index left among the active ones, done.
    make_job(ledger, "legacy", str(tmp_path), prompts=10, batch_size=10)
    ledger.r.sadd(keys.job_part("legacy", "done"), "b000001")
    ledger.r.sadd(keys.JOBS, "legacy")
    looked_at: list[str] = []
    read_state = Jobs.state

    def job_state(self: Jobs, name: str) -> tuple[str, str]:
        looked_at.append(name)
        return read_state(self, name)

    monkeypatch.setattr(Jobs, "state", job_state)
    reconciler.reconcile_once()
    # The last progress.json of the job that just finished is written (state done) ...
    progress = orjson.loads((tmp_path / "just/progress.json").read_bytes())
    assert progress["state"] == "done"
    # ... and no finished job is read beyond that, however many there are.
    assert not any(name.startswith("old") for name in looked_at)
    assert not (tmp_path / "old00/progress.json").exists()
    assert ledger.jobs.active() == ["live"]
    assert "legacy" in ledger.jobs.finished() and ledger.r.pexpiretime(keys.job("legacy")) > 0
    assert ledger.r.pexpiretime(keys.job_part("just", "progress_mark")) > 0


def test_a_worker_drops_the_metric_series_of_jobs_finished_before_the_grace(
        ledger: Ledger, reconciler: Reconciler, tmp_path: Path) -> None:
    old, recent, live = (f"{name}-{time.time_ns()}" for name in ("old", "recent", "live"))
    for job in (old, recent, live):
        make_job(ledger, job, str(tmp_path), prompts=10, batch_size=10)
        metrics.request_started(job, "gpu0@a", SERVER)
        metrics.request_ended(job, "gpu0@a", SERVER)
        metrics.prompt_finished(job, "gpu0@a", SERVER, ok=True, finish_reason="stop",
                                error_code=None, input_tokens=1, output_tokens=2,
                                reasoning_tokens=0, latency_s=1.0, queue_wait_s=0.0)
        metrics.prompt_finished(job, "gpu0@a", SERVER, ok=False, finish_reason=None,
                                error_code="timeout", input_tokens=0, output_tokens=0,
                                reasoning_tokens=0, latency_s=0.0, queue_wait_s=0.0)
        metrics.batch_finished(job, "gpu0@a", SERVER, duration_s=3.0, status="done")
    finish_all(ledger, old)
    finish_all(ledger, recent)
    ledger.r.zadd(keys.FINISHED_JOBS, {old: time.time() - FINISHED_GRACE_S - 1})
    assert {old, recent, live} <= metrics.job_series()
    assert series(old) > 20  # every family has its series (histograms one per bucket)
    assert old in reconciler.forget_finished_series()
    assert series(old) == 0 and old not in metrics.job_series()
    assert series(recent) == series(live) > 0
    # A job still running keeps counting on the same series.
    metrics.batch_finished(live, "gpu0@a", SERVER, duration_s=3.0, status="done")
    assert sample(live, "fleetgen_batch_duration_seconds_count") == 2.0
    for job in (recent, live):
        metrics.forget_job(job)


def series(job: str) -> int:
    return sum(1 for family in metrics.REGISTRY.collect() for s in family.samples
               if s.labels.get("job") == job)


def sample(job: str, name: str) -> float:
    return next(s.value for family in metrics.REGISTRY.collect() for s in family.samples
                if s.name == name and s.labels.get("job") == job)


@pytest.mark.parametrize(("raw", "seconds"), [("604800", 604800.0), ("7d", 604800.0),
                                              ("12h", 43200.0), ("1.5h", 5400.0), ("90 m", 5400.0),
                                              ("2w", 1209600.0), ("30s", 30.0)])
def test_the_retention_is_taken_as_seconds_or_a_duration(raw: str, seconds: float) -> None:
    assert Settings.from_env({"FLEETGEN_JOB_RETENTION": raw}).job_retention == seconds


@pytest.mark.parametrize("raw", ["a week", "-1", "7 days", "", "0.5", "0"])
def test_a_retention_that_is_no_duration_of_a_second_or_more_is_refused(raw: str) -> None:
    with pytest.raises(SettingsError, match="FLEETGEN_JOB_RETENTION"):
        Settings.from_env({"FLEETGEN_JOB_RETENTION": raw})


def test_the_retention_is_a_week_unless_set() -> None:
    assert Settings().job_retention == JOB_RETENTION_S == 7 * 86400
    assert Settings.from_env({}).job_retention == JOB_RETENTION_S


def test_a_job_redis_no_longer_holds_leaves_both_indexes(ledger: Ledger) -> None:
    ledger.r.sadd(keys.JOBS, "lost")
    ledger.r.zadd(keys.FINISHED_JOBS, {"lost": time.time()})
    assert ledger.jobs.settle("lost") == GONE
    assert ledger.jobs.active() == [] and ledger.jobs.finished() == {}


def test_every_part_of_a_job_the_code_writes_expires_with_it() -> None:
    """A new `fg:job:{job}:part` must join keys.JOB_PARTS, or it would outlive its job."""
    # These expire on their own, and must not be made to last.
    self_expiring = {"enqueue", "progress_due"}
    written = set()
    for package in ("fleetgen", "workers", "producer", "launcher"):
        for path in (ROOT / package).rglob("*.py"):
            written |= set(re.findall(r"job_part\([^,()]+,\s*\"(\w+)\"",
                                      path.read_text(encoding="utf-8")))
    assert "stats" in written and "progress_mark" in written
    assert written - self_expiring <= set(keys.JOB_PARTS)

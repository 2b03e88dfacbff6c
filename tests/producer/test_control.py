"""Operator actions never cost a prompt or a lie in status (real Redis, S3, simulator, workers).

Each test reproduces one way an ordinary action used to fail prompts that were never sent, or
made `status` disagree with the output: an interrupted enqueue, two enqueues at once,
pause/resume and cancel/resume cycles, a worker whose server died, a worker killed on its last
allowed attempt, an S3 outage when a batch is delivered.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from fleetgen import keys
from fleetgen.canary import Thresholds
from fleetgen.creation import creation_lock
from fleetgen.job import GenerationParams, JobManifest
from fleetgen.jobview import job_status
from fleetgen.ledger import Ledger
from fleetgen.poll import wait_until
from fleetgen.records import UNSENT_ATTEMPTS_EXHAUSTED
from fleetgen.settings import Settings
from launcher.services import S3Server
from producer import cli
from producer.enqueue import STORING, EnqueueInterrupted, EnqueueRequest, enqueue
from tests.stack import Stack, chat_rows, iter_ids, queue_depth, wait_job_done, write_jsonl
from workers.reconciler import Reconciler

pytestmark = pytest.mark.e2e

# 4 slots, answers of ~2 s: a batch of 20 runs for several seconds, long enough to act on.
SLOW = ("--max-running-requests", "4", "--decode-tps", "80", "--mean-output-tokens", "300",
        "--speed", "2")


def _exported(stack: Stack, job: str, path: Path) -> tuple[list[dict[str, Any]], str]:
    report = stack.producer("export", job, "--to", str(path))
    return [orjson.loads(x) for x in path.read_bytes().splitlines()], report.stdout


def _ids(lines: list[dict[str, Any]]) -> list[str]:
    return [x["custom_id"] if "custom_id" in x else x["id"] for x in lines]


class Interrupt:
    """A progress callback that presses Ctrl-C once enqueue has read `share` of the file to
    store its batch inputs."""

    def __init__(self, share: float) -> None:
        self.share = share

    def __call__(self, phase: str, done: int, total: int) -> None:
        if phase == STORING and done >= self.share * total:
            raise KeyboardInterrupt


@pytest.fixture
def frequent_progress(monkeypatch: pytest.MonkeyPatch) -> None:
    """Progress callbacks every 100 lines, so a small file can be interrupted mid-pass."""
    monkeypatch.setattr("producer.inputs.PROGRESS_EVERY", 100)


def test_an_interrupted_enqueue_starts_nothing_and_the_same_command_finishes_it(
    stack: Stack, tmp_path: Path, ledger: Ledger, celery_app: Any, redis_url: str,
    frequent_progress: None,
) -> None:
    rows = chat_rows(3000)
    src = write_jsonl(tmp_path / "p.jsonl", rows)
    out = tmp_path / "out"
    request = EnqueueRequest(path=src, job="cut", output=str(out), params=GenerationParams(),
                             batch_size=10, canary=Thresholds(enabled=False))
    with pytest.raises(EnqueueInterrupted) as caught:
        enqueue(request, ledger, celery_app, Interrupt(share=0.5))
    report = caught.value.report
    batches = report.batches  # 300 of 10, the last eighth cut finer (fleetgen.job.batch_sizes)
    assert batches > 300 and not report.complete
    assert 0 < report.uploaded < batches

    # Nothing runs, nothing is queued, and no reconciler round dispatches a batch of it.
    assert ledger.jobs.state("cut")[0] == "creating"
    assert queue_depth(ledger.r, keys.SHARED_QUEUE) == 0
    reconciler = Reconciler(celery_app, Settings(redis_url=redis_url), "test")
    for _ in range(3):
        assert sum(reconciler.reconcile_once().values()) == 0
    assert queue_depth(ledger.r, keys.SHARED_QUEUE) == 0
    manifest = JobManifest.from_json((out / "cut" / "manifest.json").read_bytes())
    assert not manifest.complete and manifest.prompts == 3000
    status = job_status(ledger, "cut")
    assert status.state == "creating" and "run the same enqueue command" in status.reason
    paused = stack.producer("pause", "cut", check=False)
    assert paused.returncode == 1 and "still being created" in paused.stderr

    stored = len(list((out / "cut" / "inputs").glob("*.jsonl")))
    again = stack.producer("enqueue", str(src), "--job", "cut", "--output", str(out),
                           "--batch-size", "10", "--no-canary")
    assert (f"stored {batches - stored} batch inputs ({stored} were stored by an earlier run)"
            in again.stdout)
    assert f"enqueued {batches} batches" in again.stdout
    assert JobManifest.from_json((out / "cut" / "manifest.json").read_bytes()).complete

    _, url = stack.sim("sim0", "--max-running-requests", "64", "--instant")
    stack.worker(0, url)
    done = wait_job_done(stack, "cut", timeout=300)
    assert (done.done, done.failed) == (3000, 0)
    lines, text = _exported(stack, "cut", tmp_path / "cut.jsonl")
    assert _ids(lines) == list(iter_ids(rows))
    assert "done 3,000  failed 0  missing 0" in text


def test_ctrl_c_during_enqueue_says_what_was_stored_and_how_to_resume(
    tmp_path: Path, ledger: Ledger, redis_url: str, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str], frequent_progress: None,
) -> None:
    src = write_jsonl(tmp_path / "p.jsonl", chat_rows(400))
    monkeypatch.setenv("REDIS_URL", redis_url)
    monkeypatch.setattr(cli, "_progress", lambda: Interrupt(share=0.25))
    code = cli.main(["enqueue", str(src), "--job", "ctrlc", "--output", str(tmp_path / "out"),
                     "--batch-size", "10"])
    err = capsys.readouterr().err
    assert code == 130
    stored = len(list((tmp_path / "out" / "ctrlc" / "inputs").glob("*.jsonl")))
    assert f"interrupted: job ctrlc was not started: {stored} of 66 batch inputs are stored" in err
    assert 0 < stored < 66 and "Run the same command again" in err
    # `status` says the count the message said, not an older one.
    assert (f"enqueue was interrupted ({stored} of 66 batch inputs stored at its last report)"
            in (job_status(ledger, "ctrlc").reason or ""))


def test_a_second_enqueue_of_a_job_being_created_is_refused(
    tmp_path: Path, ledger: Ledger, redis_url: str, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    src = write_jsonl(tmp_path / "p.jsonl", chat_rows(30))
    monkeypatch.setenv("REDIS_URL", redis_url)
    with creation_lock(ledger, "twice"):
        code = cli.main(["enqueue", str(src), "--job", "twice", "--output", str(tmp_path / "out")])
    assert code == 1
    assert "error: job twice is being created by another enqueue" in capsys.readouterr().err
    assert not ledger.jobs.exists("twice") and not (tmp_path / "out").exists()


def _wait_running_with_progress(ledger: Ledger, job: str) -> None:
    def started() -> bool:
        return any(ledger.r.hlen(keys.checkpoint(job, b))
                   for b in ledger.batches.running(job))

    wait_until(started, 120, interval=0.1, what=f"{job}: a batch running with finished prompts")


@pytest.mark.parametrize("stop", ["pause", "cancel"])
def test_stop_and_resume_cycles_spend_no_attempt_and_fail_nothing(
    stack: Stack, tmp_path: Path, ledger: Ledger, stop: str,
) -> None:
    rows = chat_rows(80)
    src = write_jsonl(tmp_path / "p.jsonl", rows)
    _, url = stack.sim("sim0", *SLOW)
    # With one attempt allowed, a single attempt spent by a hand-back would fail prompts unsent.
    stack.worker(0, url, extra_env={"FLEETGEN_BATCH_MAX_ATTEMPTS": "1"})
    stack.producer("enqueue", str(src), "--job", "cycles", "--output", str(tmp_path / "out"),
                   "--batch-size", "20", "--no-canary")
    for cycle in range(5):
        _wait_running_with_progress(ledger, "cycles")
        stack.producer(stop, "cycles")
        wait_until(lambda: not ledger.batches.running("cycles"), 60, interval=0.1,
                   what="the running batch handed back")
        if cycle == 0:
            # Stopped mid-job, status and a partial export count the same prompts.
            told = orjson.loads(stack.producer("status", "cycles", "--json", "--no-servers").stdout)
            partial = stack.producer("export", "cycles", "--to", str(tmp_path / "part.jsonl"),
                                     "--partial", "--json")
            held = orjson.loads(partial.stdout)
            exported = (tmp_path / "part.jsonl").read_bytes().splitlines()
            assert (told["done"], told["failed"]) == (held["done"], held["failed"])
            assert told["done"] + told["failed"] == len(exported) < 80
        stack.producer("resume", "cycles")
    status = wait_job_done(stack, "cycles", timeout=300)
    assert (status.done, status.failed) == (80, 0)
    attempts = ledger.r.hgetall(keys.job_part("cycles", "attempts"))
    assert {int(v) for v in attempts.values()} <= {0}, attempts
    lines, text = _exported(stack, "cycles", tmp_path / "cycles.jsonl")
    assert _ids(lines) == list(iter_ids(rows)) and "failed 0  missing 0" in text


def test_a_worker_killed_on_its_last_attempt_fails_only_unsent_prompts_with_the_reason(
    stack: Stack, tmp_path: Path, ledger: Ledger,
) -> None:
    rows = chat_rows(20)
    src = write_jsonl(tmp_path / "p.jsonl", rows)
    _, url = stack.sim("sim0", *SLOW)
    limited = {"FLEETGEN_BATCH_MAX_ATTEMPTS": "1"}
    first = stack.worker(0, url, extra_env=limited)
    stack.producer("enqueue", str(src), "--job", "poison", "--output", str(tmp_path / "out"),
                   "--batch-size", "20", "--no-canary")
    _wait_running_with_progress(ledger, "poison")
    first.kill()
    answered = ledger.r.hlen(keys.checkpoint("poison", "b000001"))
    stack.worker(0, url, extra_env=limited, name="gpu0b")
    status = wait_job_done(stack, "poison", timeout=180)
    lines, text = _exported(stack, "poison", tmp_path / "poison.jsonl")
    failures = [x for x in lines if "custom_id" in x]
    # Answers that reached the checkpoint before the kill are kept; only the rest fail, unsent,
    # with a reason that says so and why.
    assert len(lines) == 20 and 20 - len(failures) >= answered
    assert failures and all(f["tries"] == 0 for f in failures)
    assert {f["error"]["code"] for f in failures} == {UNSENT_ATTEMPTS_EXHAUSTED}
    assert all("not sent" in f["error"]["message"] and "last cause: its worker" in
               f["error"]["message"] for f in failures)
    # status, progress counters and export agree, and the failures are counted.
    assert (status.done, status.failed) == (20 - len(failures), len(failures))
    assert status.errors == {UNSENT_ATTEMPTS_EXHAUSTED: len(failures)}
    assert f"failed {len(failures)}  missing 0" in text

    stack.producer("requeue", "poison", "--failed")
    status = wait_job_done(stack, "poison", timeout=180)
    assert (status.done, status.failed, status.errors) == (20, 0, {})
    lines, _ = _exported(stack, "poison", tmp_path / "again.jsonl")
    assert _ids(lines) == list(iter_ids(rows)) and not any("custom_id" in x for x in lines)


def test_a_worker_whose_server_died_takes_no_more_batches(
    stack: Stack, tmp_path: Path, ledger: Ledger,
) -> None:
    rows = chat_rows(400)
    src = write_jsonl(tmp_path / "p.jsonl", rows)
    sim0, url0 = stack.sim("sim0", *SLOW)
    _, url1 = stack.sim("sim1", "--max-running-requests", "8", "--decode-tps", "80",
                        "--mean-output-tokens", "300", "--speed", "20")
    fast_handback = {"FLEETGEN_SERVER_DOWN_WAIT_S": "3"}
    gpu0 = stack.worker(0, url0, extra_env=fast_handback)
    stack.worker(1, url1, extra_env=fast_handback)
    stack.producer("enqueue", str(src), "--job", "dead", "--output", str(tmp_path / "out"),
                   "--batch-size", "10", "--no-canary")
    wait_until(lambda: "dead/" in gpu0.log() and " prompts (" in gpu0.log(), 60,
               what="gpu0 working")
    sim0.kill()
    seen = len(gpu0.log())
    status = wait_job_done(stack, "dead", timeout=300)
    assert (status.done, status.failed) == (400, 0)
    # Leases taken by gpu0 after its server died: at most one batch taken in the moment
    # before its first request failed (it used to take a dozen from the shared queue).
    after = gpu0.log()[seen:] if len(gpu0.log()) > seen else ""
    assert after.count(" prompts (") <= 1, after[-3000:]
    assert "requeued to" in after


@pytest.fixture
def own_s3(tmp_path: Path) -> Iterator[S3Server]:
    server = S3Server(data_dir=tmp_path / "s3").start()
    try:
        yield server
    finally:
        server.stop()


def test_a_batch_delivered_during_an_s3_outage_waits_instead_of_failing(
    tmp_path: Path, redis_url: str, redis_client: Any, own_s3: S3Server,
) -> None:
    stack = Stack(tmp_path, {"REDIS_URL": redis_url, **own_s3.env()})
    try:
        rows = chat_rows(40)
        src = write_jsonl(tmp_path / "p.jsonl", rows)
        stack.producer("enqueue", str(src), "--job", "outage", "--output",
                       f"s3://{own_s3.bucket}/runs", "--batch-size", "10", "--no-canary")
        _, url = stack.sim("sim0", "--max-running-requests", "16", "--instant")
        own_s3.stop()
        worker = stack.worker(0, url)
        wait_until(lambda: "outage/b0000" in worker.log() or "Received task" in worker.log(),
                   60, what="a batch delivered")
        time.sleep(3)  # deliveries meet the outage now
        own_s3.start()
        status = wait_job_done(stack, "outage", timeout=300)
        assert (status.done, status.failed) == (40, 0)
        log = worker.log_path.read_text(errors="replace")
        # No task failed, no traceback, and no lease lapsed while a sink call waited.
        assert "raised unexpected" not in log and "Traceback" not in log, log[-4000:]
        assert "lost their worker" not in log, log[-4000:]
        attempts = redis_client.hgetall(keys.job_part("outage", "attempts"))
        assert {int(v) for v in attempts.values()} <= {0}, attempts
    finally:
        stack.close()


def test_redelivered_batches_are_taken_before_fresh_ones(
    stack: Stack, tmp_path: Path, ledger: Ledger, celery_app: Any,
) -> None:
    from fleetgen.dispatch import dispatch

    src = write_jsonl(tmp_path / "p.jsonl", chat_rows(100))
    stack.producer("enqueue", str(src), "--job", "fresh", "--output", str(tmp_path / "out"),
                   "--batch-size", "10", "--no-canary")
    # b000007 comes back as a dead worker's batch would (the reconciler's re-dispatch).
    dispatch(celery_app, ledger, "fresh", ["b000007"], keys.SHARED_QUEUE, redrive=True)
    _, url = stack.sim("sim0", *SLOW)
    worker = stack.worker(0, url)
    wait_until(lambda: "fresh:b0000" in worker.log(), 60, what="a batch received")
    first = worker.log().split("fleetgen.run_batch[fresh:", 1)[1][:7]
    assert first == "b000007"


def test_an_enqueue_killed_on_this_host_does_not_block_the_next_one(
    tmp_path: Path, ledger: Ledger, redis_url: str, monkeypatch: pytest.MonkeyPatch,
    celery_app: Any,
) -> None:
    import socket
    import subprocess

    # A lock held by a process of this host that no longer exists (kill -9).
    dead = subprocess.Popen(["true"])
    dead.wait()
    ledger.r.set(keys.job_part("killed", "enqueue"), f"{socket.gethostname()}:{dead.pid}:abcd",
                 px=30_000)
    src = write_jsonl(tmp_path / "p.jsonl", chat_rows(30))
    monkeypatch.setenv("REDIS_URL", redis_url)
    assert cli.main(["enqueue", str(src), "--job", "killed", "--output", str(tmp_path / "out"),
                     "--batch-size", "10"]) == 0
    assert ledger.jobs.state("killed")[0] == "running"

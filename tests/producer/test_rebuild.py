"""Redis loses a job mid-way (restarted without AOF or RDB, a failover that lost writes,
FLUSHALL): `export --output` reads the sink alone, and the same `enqueue` or `rebuild` puts the
ledger back from the sink (producer/rebuild.py), requeue rounds and their counter included, so
that `status` equals `export` and the job finishes with every prompt exactly once.

The fast tests use a real Redis, a folder sink, the real `enqueue`, and batches written as a
worker writes them (tests/producer/test_control_requeue.py `SinkJob`); the last one runs real workers.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

import orjson
import pytest

from fleetgen import keys
from fleetgen.jobview import job_status
from fleetgen.ledger import Ledger
from fleetgen.records import error_record
from producer.cli import main
from tests.producer.test_control_requeue import (
    CONTEXT,
    ORIGIN,
    SERVER,
    SinkJob,
    assert_status_is_the_export,
    exported,
)
from tests.stack import Stack, chat_rows, iter_ids, wait_job_done, write_jsonl


def half_requeued(ledger: Ledger, app: Any, folder: Path) -> SinkJob:
    """A job of 3 batches of 10: b000001 written (2 failures), round r01 written (one of them
    answered, one failed again), round r02 stored and not written, b000002 written after it
    (1 failure), b000003 not written."""
    job = SinkJob(ledger, app, folder)
    job.write("b000001", {"p00001": CONTEXT, "p00002": CONTEXT})
    assert job.requeue().round == 1
    job.write("r01-000001", {"p00002": SERVER})
    assert job.requeue().round == 2
    job.write("b000002", {"p00013": CONTEXT})
    return job


def test_export_reads_a_job_redis_lost_from_its_output_alone(
    ledger: Ledger, celery_app: Any, tmp_path: Path, cli_env: None,
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
) -> None:
    job = half_requeued(ledger, celery_app, tmp_path)
    job.write_pending(fail={"p00002": SERVER})
    before = exported(capsys, "rounds", tmp_path / "before.jsonl")
    ledger.r.flushdb()

    code = main(["export", "rounds", "--to", str(tmp_path / "e.jsonl")])
    err = capsys.readouterr().err
    assert code == 1 and "no job named 'rounds' in Redis" in err and "rebuild" not in err
    monkeypatch.setenv("FLEETGEN_OUTPUT", job.output)  # the output holds the job: say so
    code = main(["export", "rounds", "--to", str(tmp_path / "e.jsonl")])
    err = capsys.readouterr().err
    assert code == 1 and f"`python -m producer rebuild rounds --output {job.output}`" in err
    assert f"`python -m producer export rounds --to FILE --output {job.output}`" in err

    code = main(["export", "rounds", "--to", str(tmp_path / "e.jsonl"), "--output", job.output])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert (f"note: Redis does not know the job: read from {job.output} alone (the quality "
            "canary's verdict, kept in Redis, is not checked)") in out
    assert ("reconcile: total 30  input 30  done 28  failed 2  missing 0  duplicates dropped 0"
            "  (failed by code: context_length_exceeded 1, server_error 1)") in out
    assert (tmp_path / "e.jsonl").read_bytes() == (tmp_path / "before.jsonl").read_bytes()
    assert before["failed_by_code"] == {CONTEXT: 1, SERVER: 1}
    assert not ledger.jobs.exists("rounds")


def test_rerunning_the_same_enqueue_after_redis_lost_the_job_rebuilds_it_with_its_rounds(
    ledger: Ledger, celery_app: Any, tmp_path: Path, cli_env: None,
    capsys: pytest.CaptureFixture[str],
) -> None:
    job = half_requeued(ledger, celery_app, tmp_path)
    to = tmp_path / "e.jsonl"
    before = assert_status_is_the_export(capsys, ledger, "rounds", to)
    ledger.r.flushdb()

    report = job.enqueue()
    assert report.rebuilt is not None
    assert report.rebuilt.lines() == [
        "batches: 5 (3 enqueued, 2 requeued), 3 written, 2 to run",
        "requeue rounds: r01 to r02; the next is r03",
        "prompts: 30: 18 done, 1 failed, 11 to go (failed by code: context_length_exceeded 1)"]
    # b000003 and round r02 are queued again; nothing written is.
    assert (report.enqueued, report.skipped_done) == (2, 3)
    assert set(ledger.batches.queued("rounds")) == {"b000003", "r02-000001"}
    status = assert_status_is_the_export(capsys, ledger, "rounds", to)
    assert (status.done, status.failed, status.errors, status.state) == (
        before.done, before.failed, before.errors, before.state)
    assert asdict(status.batches) == {"total": 5, "done": 3, "running": 0, "queued": 2}
    assert status.state == "running" and status.checkpointed == 0

    # The round counter came back: the next round is r03, not a second r01.
    job.write("b000003", {"p00024": CONTEXT})
    assert job.requeue().round == 3
    job.write_pending()
    status = assert_status_is_the_export(capsys, ledger, "rounds", to)
    assert (status.state, status.done, status.failed) == ("done", 30, 0)
    rows = [orjson.loads(x) for x in to.read_bytes().splitlines()]
    assert [r["id"] for r in rows] == job.ids
    assert rows[2]["content"] == "An answer from r02-000001."


def test_rebuild_puts_back_a_lost_job_says_what_it_found_and_keeps_checkpoints(
    ledger: Ledger, celery_app: Any, tmp_path: Path, cli_env: None,
    capsys: pytest.CaptureFixture[str],
) -> None:
    job = half_requeued(ledger, celery_app, tmp_path)
    ledger.r.flushdb()
    # A worker that outlived the loss checkpointed one prompt of b000003 into the empty Redis.
    failed = error_record("p00021", 22, "maximum context length is 40960", 400, ORIGIN, 1)
    ledger.r.hset(keys.checkpoint("rounds", "b000003"), "p00021", orjson.dumps(failed))

    assert main(["rebuild", "rounds"]) == 2
    assert capsys.readouterr().err == (
        "error: Redis does not know job rounds: name its output, `python -m producer rebuild "
        "rounds --output URI`\n")
    assert main(["rebuild", "rounds", "--output", job.output]) == 0
    assert capsys.readouterr().out.splitlines() == [
        f"job rounds rebuilt from {tmp_path / 'out' / 'rounds'}",
        "  batches: 5 (3 enqueued, 2 requeued), 3 written, 2 to run",
        "  requeue rounds: r01 to r02; the next is r03",
        "  prompts: 30: 18 done, 1 failed, 11 to go (failed by code: context_length_exceeded 1)",
        "  kept 1 prompts checkpointed in Redis (their batches are not written yet)",
        "  re-dispatched 2 batches"]
    status = assert_status_is_the_export(capsys, ledger, "rounds", tmp_path / "e.jsonl")
    assert status.checkpointed == 1 and status.batches.queued == 2
    assert int(ledger.r.hget(keys.job("rounds"), keys.JOB_ROUNDS) or 0) == 2

    # Run again on a ledger that knows the job, it changes nothing and sends nothing twice.
    assert main(["rebuild", "rounds"]) == 0
    assert "re-dispatched 0 batches" in capsys.readouterr().out
    assert job_status(ledger, "rounds").checkpointed == 1
    code = main(["rebuild", "rounds", "--output", str(tmp_path / "elsewhere")])
    assert code == 1 and "writes to" in capsys.readouterr().err


def test_a_paused_job_redis_lost_is_rebuilt_paused_and_a_resumed_one_running(
    ledger: Ledger, celery_app: Any, tmp_path: Path, cli_env: None,
    capsys: pytest.CaptureFixture[str],
) -> None:
    job = SinkJob(ledger, celery_app, tmp_path)
    job.write("b000001")
    assert main(["pause", "rounds"]) == 0
    ledger.r.flushdb()
    assert main(["rebuild", "rounds", "--output", job.output]) == 0
    out = capsys.readouterr().out
    assert ("  paused as its output recorded (paused by user): `python -m producer resume "
            "rounds` runs it again") in out.splitlines()
    assert "re-dispatched" not in out
    assert ledger.jobs.state("rounds") == ("paused", "paused by user")
    assert not ledger.batches.queued("rounds")

    assert main(["resume", "rounds"]) == 0
    ledger.r.flushdb()
    assert main(["rebuild", "rounds", "--output", job.output]) == 0
    out = capsys.readouterr().out
    assert "as its output recorded" not in out and "re-dispatched 2 batches" in out
    assert ledger.jobs.state("rounds")[0] == "running"


def test_rebuild_of_a_job_whose_enqueue_did_not_finish_says_to_run_it_again(
    ledger: Ledger, celery_app: Any, tmp_path: Path, cli_env: None,
    capsys: pytest.CaptureFixture[str],
) -> None:
    job = SinkJob(ledger, celery_app, tmp_path)
    manifest = ledger.jobs.load("rounds")
    raw = orjson.loads(manifest.to_json())
    raw["complete"] = False
    job.sink.put(keys.sink_manifest("rounds"), orjson.dumps(raw))
    job.sink.put(keys.sink_input("rounds", "b000003"), b"")
    ledger.r.flushdb()
    assert main(["rebuild", "rounds", "--output", job.output]) == 0
    out = capsys.readouterr().out
    assert "enqueue of job rounds did not finish (3 of 3 batch inputs stored): run the same " \
           "enqueue command to finish it" in out
    assert "re-dispatched" not in out
    assert ledger.jobs.state("rounds")[0] == "creating" and not ledger.batches.queued("rounds")


POISON = "NEEDS-A-LONGER-CONTEXT"
SLOW = ("--max-running-requests", "4", "--decode-tps", "80", "--mean-output-tokens", "200",
        "--speed", "10", "--fail-prompt", POISON)


@pytest.mark.e2e
def test_a_job_whose_redis_was_flushed_mid_way_is_rebuilt_by_its_enqueue_and_ends_exactly_once(
    stack: Stack, tmp_path: Path, redis_client: Any,
) -> None:
    from fleetgen.poll import wait_until

    rows = chat_rows(120)
    for i in (5, 47, 88):
        rows[i] = {"id": f"p{i:05d}", "prompt": f"This one carries {POISON}."}
    src = write_jsonl(tmp_path / "p.jsonl", rows)
    out = tmp_path / "out"
    _, url = stack.sim("sim0", *SLOW)
    worker = stack.worker(0, url)
    enqueue = ("enqueue", str(src), "--job", "lost", "--output", str(out), "--batch-size", "10",
               "--no-canary")
    stack.producer(*enqueue)
    ledger = Ledger(redis_client)
    wait_until(lambda: ledger.batches.is_done("lost", "b000001") and len(ledger.batches.done("lost")) >= 4,
               120, what="b000001 and 3 more batches written")
    # A requeue round waits to run (the job is paused) when Redis loses everything.
    stack.producer("pause", "lost")
    wait_until(lambda: not ledger.batches.running("lost"), 60, what="running batches stopped")
    assert "requeued" in stack.producer("requeue", "lost", "--failed").stdout
    redis_client.flushall()
    # The worker outlives the loss; it is stopped so that the figures below hold still.
    worker.stop()
    assert "no job named 'lost'" in stack.producer("status", "lost", check=False).stderr

    again = stack.producer(*enqueue)
    assert "Redis did not know the job: its ledger was rebuilt from" in again.stdout
    assert "requeue rounds: r01 to r01; the next is r02" in again.stdout
    # The pause was recorded in the output: the rebuilt job keeps it.
    assert "paused as its output recorded (paused by user)" in again.stdout
    status = orjson.loads(stack.producer("status", "lost", "--json", "--no-servers").stdout)
    partial = orjson.loads(stack.producer("export", "lost", "--to", str(tmp_path / "p.out"),
                                          "--partial", "--json").stdout)
    assert {k: status[k] for k in ("done", "failed")} == {k: partial[k] for k in ("done", "failed")}
    assert status["errors"] == partial["failed_by_code"]
    assert status["done"] >= 30 and status["state"] == "paused"

    stack.producer("resume", "lost")
    stack.worker(0, url, name="gpu0b")
    status = wait_job_done(stack, "lost", timeout=240)
    export = orjson.loads(stack.producer("export", "lost", "--to", str(tmp_path / "all.jsonl"),
                                         "--json").stdout)
    assert (export["done"], export["failed"], export["missing"]) == (117, 3, 0)
    assert export["duplicates_dropped"] == 0
    assert (status.done, status.failed) == (117, 3)
    assert status.errors == export["failed_by_code"] == {CONTEXT: 3}
    lines = [orjson.loads(x) for x in (tmp_path / "all.jsonl").read_bytes().splitlines()]
    assert [x.get("custom_id") or x["id"] for x in lines] == list(iter_ids(rows))

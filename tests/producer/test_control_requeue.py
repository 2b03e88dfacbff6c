"""`requeue --failed` rounds on a real Redis and a folder sink: each prompt's newest outcome is
read one way (producer/sinkview.py) by `requeue`, `export` and the counters `status` shows,
rounds are ordered by number past round 99, and two requeues at once send a prompt once.

Jobs are made by the real `enqueue`; batches are written as a worker writes them (its errors,
then its results, create-if-absent, then the ledger's record), without a worker.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import orjson
import pytest

from fleetgen import keys
from fleetgen.job import GenerationParams
from fleetgen.jobview import JobStatus, job_status
from fleetgen.ledger import Ledger
from fleetgen.poll import wait_until
from fleetgen.records import (
    Origin,
    answer_key,
    error_record,
    is_failure,
    result_record,
    written_counts,
)
from fleetgen.sink import LocalSink, Sink, open_sink
from producer import control
from producer.cli import main
from producer.enqueue import EnqueueReport, EnqueueRequest, enqueue
from tests.stack import chat_rows, write_jsonl

ORIGIN = Origin("http://127.0.0.1:30000", "gpu0@test", 1)
CONTEXT, SERVER = "context_length_exceeded", "server_error"
MESSAGES = {CONTEXT: (400, "maximum context length is 40960"),
            SERVER: (500, "Internal Server Error")}


class SinkJob:
    """A job made by the real `enqueue` (30 prompts in batches of 10 unless told), whose
    batches `write` writes as a worker does (workers/batch.py `_write`)."""

    def __init__(self, ledger: Ledger, app: Any, folder: Path, name: str = "rounds", *,
                 prompts: int = 30) -> None:
        self.ledger, self.app, self.name = ledger, app, name
        self.output = str(folder / "out")
        self.source = write_jsonl(folder / f"{name}.jsonl", chat_rows(prompts))
        self.ids = [f"p{i:05d}" for i in range(prompts)]
        self.sink: Sink = open_sink(self.output)
        self.enqueue()

    def enqueue(self) -> EnqueueReport:
        """The same enqueue command, as a user re-runs it."""
        return enqueue(EnqueueRequest(path=self.source, job=self.name, output=self.output,
                                      params=GenerationParams(), batch_size=10),
                       self.ledger, self.app)

    def write(self, batch: str, fail: Mapping[str, str] | None = None) -> None:
        """Write `batch`: the answers whose keys (`answer_key`: the id, or `id/index`) are in
        `fail` fail with their code, the others are answered."""
        fail = fail or {}
        raw = self.sink.get(keys.sink_input(self.name, batch)) or b""
        records = []
        for row in (orjson.loads(line) for line in raw.splitlines() if line):
            key, sample = answer_key(row["id"], row.get("sample")), row.get("sample")
            if key in fail:
                status, message = MESSAGES[fail[key]]
                records.append(error_record(row["id"], row["line"], message, status, ORIGIN, 1,
                                            code=fail[key], sample=sample))
            else:
                response = {"choices": [{"finish_reason": "stop", "message": {
                    "content": f"An answer from {batch}.", "reasoning_content": "thinking"}}],
                    "usage": {"prompt_tokens": 5, "completion_tokens": 7, "reasoning_tokens": 3}}
                records.append(result_record(row["id"], row["line"], response, 0.5, ORIGIN,
                                             sample))
        bad = [r for r in records if is_failure(r)]
        if bad:
            self.sink.put_new(keys.sink_errors(self.name, batch), lines(bad))
        self.sink.put_new(keys.sink_result(self.name, batch),
                          lines([r for r in records if not is_failure(r)]))
        self.ledger.batches.finish_and_settle(self.name, batch, written_counts(records),
                                              ORIGIN.worker, [])

    def write_pending(self, fail: Mapping[str, str] | None = None) -> list[str]:
        """Write every batch of the job the ledger has not recorded as done."""
        done = self.ledger.batches.done(self.name)
        todo = [b for b in self.ledger.jobs.batches(self.name) if b not in done]
        for batch in todo:
            self.write(batch, fail)
        return todo

    def requeue(self) -> control.RequeueReport:
        return control.requeue_failed(self.ledger, self.app, self.name)

    def round_inputs(self) -> dict[str, list[str]]:
        """Requeue batch -> the ids its stored input holds."""
        prefix = f"{self.name}/inputs/"
        return {Path(key).stem: [orjson.loads(x)["id"] for x in (self.sink.get(key) or b"").splitlines()]
                for key in self.sink.list_keys(prefix) if keys.requeue_round(Path(key).stem)}


def lines(records: list[dict[str, Any]]) -> bytes:
    return b"".join(orjson.dumps(r) + b"\n" for r in records)


def exported(capsys: pytest.CaptureFixture[str], job: str, to: Path,
             *flags: str) -> dict[str, Any]:
    """`export JOB --json --partial`'s reconcile (the dataset written to `to`)."""
    code = main(["export", job, "--to", str(to), "--json", "--partial", "--force", *flags])
    out, err = capsys.readouterr()
    assert code == 0, err
    found: dict[str, Any] = orjson.loads(out)
    return found


def assert_status_is_the_export(capsys: pytest.CaptureFixture[str], ledger: Ledger, job: str,
                                to: Path) -> JobStatus:
    export = exported(capsys, job, to)
    status = job_status(ledger, job)
    assert {"done": status.done, "failed": status.failed, "errors": status.errors} == {
        "done": export["done"], "failed": export["failed"], "errors": export["failed_by_code"]}
    return status


def test_rounds_past_ninety_nine_are_read_by_number_and_status_counts_what_export_counts(
    ledger: Ledger, celery_app: Any, tmp_path: Path, cli_env: None,
    capsys: pytest.CaptureFixture[str],
) -> None:
    job = SinkJob(ledger, celery_app, tmp_path)
    job.write_pending(fail={"p00001": CONTEXT, "p00002": CONTEXT})
    # 98 rounds ran before: the next ones are r99, r100, r101 (`r100-` sorts before `r99-`).
    ledger.r.hset(keys.job("rounds"), keys.JOB_ROUNDS, 98)
    assert job.requeue().round == 99
    job.write_pending(fail={"p00001": CONTEXT, "p00002": SERVER})
    assert job.requeue().round == 100
    job.write_pending(fail={"p00001": SERVER, "p00002": SERVER})
    to = tmp_path / "e.jsonl"
    status = assert_status_is_the_export(capsys, ledger, "rounds", to)
    assert (status.failed, status.errors) == (2, {SERVER: 2})

    # Round 100's failures are the newest: those are taken out of the figures, not round 99's.
    report = job.requeue()
    assert (report.round, report.prompts) == (101, 2)
    status = assert_status_is_the_export(capsys, ledger, "rounds", to)
    assert (status.done, status.failed, status.errors) == (28, 0, {})
    assert sorted(job.round_inputs()) == ["r100-000001", "r101-000001", "r99-000001"]

    assert job.write_pending(fail={"p00002": CONTEXT}) == ["r101-000001"]
    status = assert_status_is_the_export(capsys, ledger, "rounds", to)
    assert (status.state, status.done, status.failed) == ("done", 29, 1)
    assert status.errors == {CONTEXT: 1}
    rows = [orjson.loads(x) for x in to.read_bytes().splitlines()]
    assert [r.get("custom_id") or r["id"] for r in rows] == job.ids
    assert rows[1]["content"] == "An answer from r101-000001."
    assert rows[2]["error"]["code"] == CONTEXT


def test_the_ledger_lists_requeue_batches_by_round_number(
    ledger: Ledger, celery_app: Any, tmp_path: Path,
) -> None:
    SinkJob(ledger, celery_app, tmp_path)
    ledger.r.sadd(keys.job_part("rounds", "extra"), "r100-000001", "r99-000002", "r99-000001")
    assert ledger.jobs.batches("rounds") == ["b000001", "b000002", "b000003", "r99-000001",
                                            "r99-000002", "r100-000001"]
    assert [keys.requeue_batch_id(n, 1) for n in (1, 99, 100)] == [
        "r01-000001", "r99-000001", "r100-000001"]


def test_two_requeues_at_once_send_each_failed_prompt_once(
    ledger: Ledger, redis_url: str, celery_app: Any, tmp_path: Path, cli_env: None,
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    job = SinkJob(ledger, celery_app, tmp_path)
    job.write_pending(fail={"p00003": CONTEXT, "p00014": CONTEXT, "p00025": SERVER})
    # The second requeue starts while the first stores its round's input (after it read the
    # failures, before it recorded the round); the first goes on once the second has either
    # finished or says it waits for the job's lock.
    waiting = threading.Event()

    class Says(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "waits for the job's lock" in record.getMessage():
                waiting.set()

    caplog.set_level(logging.INFO, logger="fleetgen.creation")
    logger = logging.getLogger("fleetgen.creation")
    handler = Says(logging.INFO)
    logger.addHandler(handler)
    second: list[control.RequeueReport] = []
    started: list[threading.Thread] = []
    put = LocalSink.put

    def put_then_race(self: LocalSink, key: str, data: bytes) -> None:
        if keys.requeue_round(Path(key).stem) and not started:
            other = Ledger.from_url(redis_url)
            thread = threading.Thread(target=lambda: second.append(
                control.requeue_failed(other, celery_app, "rounds")))
            started.append(thread)
            thread.start()
            wait_until(lambda: waiting.is_set() or not thread.is_alive(), 30,
                       what="the second requeue to finish or wait for the lock")
        put(self, key, data)

    monkeypatch.setattr(LocalSink, "put", put_then_race)
    try:
        first = job.requeue()
        started[0].join(60)
    finally:
        logger.removeHandler(handler)
    assert (first.prompts, first.round) == (3, 1)
    assert [(r.prompts, r.batches) for r in second] == [(0, 0)]
    assert job.round_inputs() == {"r01-000001": ["p00003", "p00014", "p00025"]}
    status = assert_status_is_the_export(capsys, ledger, "rounds", tmp_path / "e.jsonl")
    assert (status.done, status.failed) == (27, 0)

    job.write_pending()
    export = exported(capsys, "rounds", tmp_path / "e.jsonl")
    assert (export["done"], export["duplicates_dropped"]) == (30, 0)
    assert job_status(ledger, "rounds").done == 30


def test_a_requeue_waiting_for_a_lock_another_command_keeps_says_who_holds_it(
    ledger: Ledger, celery_app: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    from fleetgen import creation
    from fleetgen.errors import JobBusyError

    job = SinkJob(ledger, celery_app, tmp_path)
    job.write_pending(fail={"p00003": CONTEXT})
    monkeypatch.setattr(creation, "JOB_LOCK_WAIT_S", 0.3)
    monkeypatch.setattr(control, "JOB_LOCK_WAIT_S", 0.3)
    with creation.job_lock(ledger, "rounds", "rebuild"), \
            pytest.raises(JobBusyError, match=r"job rounds is busy: a rebuild \(host:pid .+\) "
                                              r"holds its lock after 0s"):
        job.requeue()
    assert job.requeue().prompts == 1


def test_a_round_stored_but_not_recorded_is_named_and_sends_nothing_twice(
    ledger: Ledger, celery_app: Any, tmp_path: Path,
) -> None:
    from fleetgen.errors import JobError

    job = SinkJob(ledger, celery_app, tmp_path)
    job.write_pending(fail={"p00003": CONTEXT})
    # A requeue that stopped after storing its round's input, before recording it.
    job.sink.put(keys.sink_input("rounds", "r01-000001"),
                 job.sink.get(keys.sink_input("rounds", "b000001")) or b"")
    with pytest.raises(JobError, match=r"requeue batches the ledger does not know "
                                       r"\(r01-000001\).*producer rebuild rounds"):
        job.requeue()

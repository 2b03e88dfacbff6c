"""`producer export`: streamed batch by batch, reconciled with the manifest, never overwriting.

Jobs are written straight into a real sink (a folder, or SeaweedFS) the way enqueue and the
workers write them, and the manifest into a real Redis; `python -m producer export` runs
in-process (`producer.cli.main`).
"""

from __future__ import annotations

import hashlib
import os
import sys
import tracemalloc
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import orjson
import pytest

from fleetgen import keys
from fleetgen.errors import SinkError
from fleetgen.job import GenerationParams, InputInfo, JobManifest
from fleetgen.ledger import Ledger
from fleetgen.records import Origin, error_record, result_record
from fleetgen.sink import LocalSink, Sink, open_sink
from producer import export
from producer.cli import main

ORIGIN = Origin("http://127.0.0.1:30000", "gpu0@test", 1)
CONTEXT = "maximum context length is 40960"


class Job:
    """A job in a sink: batch inputs as enqueue stores them, results and errors as workers
    write them, `requeue --failed` rounds as control.requeue_failed names them."""

    def __init__(self, ledger: Ledger, sink: Sink, folder: Path, name: str = "job", *,
                 prompts: int = 30, batch_size: int = 10, complete: bool = True,
                 answer: str = "An answer.") -> None:
        self.sink, self.name, self.answer = sink, name, answer
        self.ids = [f"p{i:05d}" for i in range(prompts)]
        self.source = folder / f"{name}-prompts.jsonl"
        self.source.write_bytes(b"".join(orjson.dumps({"id": i, "prompt": f"Say {i}."}) + b"\n"
                                         for i in self.ids))
        data = self.source.read_bytes()
        self.manifest = JobManifest(
            name=name, output=sink.uri, prompts=prompts, batch_size=batch_size,
            input=InputInfo(str(self.source), hashlib.sha256(data).hexdigest(), prompts, len(data)),
            batches=-(-prompts // batch_size), queue=keys.SHARED_QUEUE, params=GenerationParams(),
            complete=complete)
        ledger.jobs.save(self.manifest)
        sink.put(keys.sink_manifest(name), self.manifest.to_json())
        self.size = batch_size
        self.rounds = 0

    def batch(self, number: int) -> list[str]:
        return self.ids[(number - 1) * self.size:number * self.size]

    def store_inputs(self, upto: int | None = None) -> None:
        for number in range(1, (upto or self.manifest.batches) + 1):
            self._put_input(keys.batch_id(number), self.batch(number))

    def run(self, number: int, *, fail: Iterable[str] = (), order: Iterable[str] | None = None) -> None:
        """Write batch `number`'s outcomes: `fail` as errors, the others as answers."""
        self._outcomes(keys.batch_id(number), list(order or self.batch(number)), set(fail))

    def requeue(self, ids: list[str], *, fail: Iterable[str] = (), run: bool = True,
                round_no: int | None = None) -> str:
        self.rounds = round_no or self.rounds + 1
        batch = keys.requeue_batch_id(self.rounds, 1)
        self._put_input(batch, ids)
        if run:
            self._outcomes(batch, ids, set(fail))
        return batch

    def _put_input(self, batch: str, ids: list[str]) -> None:
        self.sink.put(keys.sink_input(self.name, batch), b"".join(
            orjson.dumps({"id": i, "line": 1, "body": {"messages": []}}) + b"\n" for i in ids))

    def _outcomes(self, batch: str, ids: list[str], fail: set[str]) -> None:
        response = {"choices": [{"finish_reason": "stop", "message": {
            "content": self.answer, "reasoning_content": f"thinking in {batch}"}}],
            "usage": {"prompt_tokens": 5, "completion_tokens": 7, "reasoning_tokens": 3}}
        bad = [error_record(i, 1, CONTEXT, 400, ORIGIN, 1) for i in ids if i in fail]
        good = [result_record(i, 1, response, 0.5, ORIGIN) for i in ids if i not in fail]
        if bad:
            self.sink.put(keys.sink_errors(self.name, batch), lines(bad))
        self.sink.put(keys.sink_result(self.name, batch), lines(good))

    def finish(self, fail: Iterable[str] = ()) -> None:
        self.store_inputs()
        for number in range(1, self.manifest.batches + 1):
            self.run(number, fail=fail)


def lines(records: list[dict[str, Any]]) -> bytes:
    return b"".join(orjson.dumps(r) + b"\n" for r in records)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in path.read_bytes().splitlines()]


def outcome_ids(rows: list[dict[str, Any]]) -> list[str]:
    return [r.get("custom_id") or r["id"] for r in rows]


def run_export(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["export", *args])
    out, err = capsys.readouterr()
    return code, out, err


def reconcile(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, dict[str, Any], str]:
    code, out, err = run_export(capsys, *args, "--json")
    return code, orjson.loads(out), err


@pytest.fixture
def sink(tmp_path: Path) -> Sink:
    return open_sink(str(tmp_path / "out"))


def test_export_writes_every_prompt_once_in_input_order(
    ledger: Ledger, sink: Sink, tmp_path: Path, cli_env: None, capsys: pytest.CaptureFixture[str]
) -> None:
    job = Job(ledger, sink, tmp_path, prompts=35)
    job.store_inputs()
    for number in range(1, 5):
        # Workers may finish a batch's prompts in any order; the export follows the input.
        job.run(number, fail={"p00012", "p00031"}, order=reversed(job.batch(number)))
    to = tmp_path / "export.jsonl"
    code, out, _ = run_export(capsys, "job", "--to", str(to))
    assert code == 0
    assert ("reconcile: total 35  input 35  done 33  failed 2  missing 0  duplicates dropped 0"
            "  (failed by code: context_length_exceeded 2)") in out
    rows = read_jsonl(to)
    assert outcome_ids(rows) == job.ids
    assert rows[12]["error"] == {"code": "context_length_exceeded", "message": CONTEXT}
    assert rows[0]["content"] == "An answer." and rows[0]["usage"]["completion_tokens"] == 7


def test_the_three_formats_keep_their_record_shapes(
    ledger: Ledger, sink: Sink, tmp_path: Path, cli_env: None, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import pyarrow.parquet as pq

    job = Job(ledger, sink, tmp_path, prompts=25)
    job.finish(fail={"p00003"})
    assert run_export(capsys, "job", "--to", str(tmp_path / "a.jsonl"))[0] == 0
    stored = read_jsonl(tmp_path / "a.jsonl")
    assert stored[0] == orjson.loads((sink.get(keys.sink_result("job", "b000001")) or b"").split(b"\n")[0])

    assert run_export(capsys, "job", "--to", str(tmp_path / "b.jsonl"), "--format", "openai")[0] == 0
    openai = read_jsonl(tmp_path / "b.jsonl")
    assert openai[0]["custom_id"] == "p00000" and openai[0]["error"] is None
    body = openai[0]["response"]["body"]
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 7, "reasoning_tokens": 3,
                             "total_tokens": 12}
    assert body["choices"][0]["message"]["reasoning_content"] == "thinking in b000001"
    assert openai[3] == {"id": "fg-p00003", "custom_id": "p00003",
                         **{k: stored[3][k] for k in ("response", "error")}}

    # Row groups of 10 rows: the file is written in parts, never held whole.
    monkeypatch.setattr(export, "ROW_GROUP_ROWS", 10)
    assert run_export(capsys, "job", "--to", str(tmp_path / "c.parquet"), "--format", "parquet")[0] == 0
    parquet = pq.ParquetFile(tmp_path / "c.parquet")
    assert parquet.metadata.num_row_groups == 3
    table = parquet.read()
    assert table.column_names == list(export.PARQUET_COLUMNS)
    assert table.column("id").to_pylist() == job.ids
    row = table.slice(3, 1).to_pylist()[0]
    assert (row["status"], row["content"], row["error"]) == ("failed", None, CONTEXT)
    assert table.slice(0, 1).to_pylist()[0] == {
        "id": "p00000", "status": "ok", "reasoning_content": "thinking in b000001",
        "content": "An answer.", "tool_calls": None, "finish_reason": "stop", "prompt_tokens": 5,
        "completion_tokens": 7, "reasoning_tokens": 3, "error": None, "worker": "gpu0@test",
        "attempt": 1}


def test_every_exported_line_names_its_input_id_in_the_same_field_in_each_format(
    ledger: Ledger, sink: Sink, tmp_path: Path, cli_env: None, capsys: pytest.CaptureFixture[str],
) -> None:
    import pyarrow.parquet as pq

    job = Job(ledger, sink, tmp_path, prompts=12)
    job.finish(fail={"p00002", "p00007"})
    for fmt in export.FORMATS:
        assert run_export(capsys, "job", "--to", str(tmp_path / f"e.{fmt}"), "--format", fmt)[0] == 0
    answers_and_failures = read_jsonl(tmp_path / "e.jsonl")
    assert [r["id"] for r in answers_and_failures] == job.ids
    assert [("error" in r) for r in answers_and_failures].count(True) == 2
    openai = read_jsonl(tmp_path / "e.openai")
    assert [r["custom_id"] for r in openai] == job.ids
    assert [r["id"] for r in openai] == [f"fg-{i}" for i in job.ids]
    assert pq.read_table(tmp_path / "e.parquet").column("id").to_pylist() == job.ids


def test_parquet_without_pyarrow_says_how_to_install_it_before_reading_the_job(
    ledger: Ledger, sink: Sink, tmp_path: Path, cli_env: None, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from producer import sinkview

    Job(ledger, sink, tmp_path).finish()
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # what an import finds when not installed

    def no_reading(*args: object) -> None:
        raise AssertionError("the job was read")

    monkeypatch.setattr(sinkview, "survey", no_reading)
    to = tmp_path / "e.parquet"
    code, out, err = run_export(capsys, "job", "--to", str(to), "--format", "parquet")
    assert (code, out, to.exists()) == (2, "", False)
    assert err == ("error: --format parquet needs pyarrow, which is not installed: "
                   "pip install 'fleetgen[parquet]'\n")


def test_a_requeued_failure_that_then_succeeded_is_exported_once_as_a_success(
    ledger: Ledger, sink: Sink, tmp_path: Path, cli_env: None, capsys: pytest.CaptureFixture[str]
) -> None:
    job = Job(ledger, sink, tmp_path)
    job.finish(fail={"p00004", "p00015"})
    job.requeue(["p00004", "p00015"])
    code, report, _ = reconcile(capsys, "job", "--to", str(tmp_path / "e.jsonl"))
    assert code == 0
    assert (report["done"], report["failed"], report["missing"], report["duplicates_dropped"]) == (
        30, 0, 0, 0)
    rows = read_jsonl(tmp_path / "e.jsonl")
    assert outcome_ids(rows) == job.ids
    assert rows[4]["reasoning_content"] == "thinking in r01-000001" and "custom_id" not in rows[4]


def test_a_second_success_of_the_same_prompt_is_dropped_and_counted(
    ledger: Ledger, sink: Sink, tmp_path: Path, cli_env: None, capsys: pytest.CaptureFixture[str]
) -> None:
    job = Job(ledger, sink, tmp_path)
    job.finish(fail={"p00004", "p00025"})
    # `requeue --failed` twice before the first round ran: both rounds answer both prompts.
    job.requeue(["p00004", "p00025"])
    job.requeue(["p00004", "p00025"])
    code, report, _ = reconcile(capsys, "job", "--to", str(tmp_path / "e.jsonl"))
    assert code == 0
    assert (report["done"], report["duplicates_dropped"]) == (30, 2)
    rows = read_jsonl(tmp_path / "e.jsonl")
    assert outcome_ids(rows) == job.ids
    assert rows[25]["reasoning_content"] == "thinking in r01-000001"


def test_a_success_is_final_and_among_failures_the_latest_round_wins(
    ledger: Ledger, sink: Sink, tmp_path: Path, cli_env: None, capsys: pytest.CaptureFixture[str]
) -> None:
    job = Job(ledger, sink, tmp_path)
    job.finish(fail={"p00001", "p00002"})
    job.requeue(["p00001", "p00002"], fail={"p00001"}, round_no=9)
    # Round 100 sorts before round 99 by name; it is later, so its failure is the outcome.
    job.requeue(["p00001", "p00002"], fail={"p00001", "p00002"}, round_no=100)
    code, report, _ = reconcile(capsys, "job", "--to", str(tmp_path / "e.jsonl"))
    assert code == 0
    assert (report["done"], report["failed"], report["duplicates_dropped"]) == (29, 1, 0)
    rows = read_jsonl(tmp_path / "e.jsonl")
    assert rows[2]["reasoning_content"] == "thinking in r09-000001"  # the success stands
    failed = rows[1]
    assert failed["custom_id"] == "p00001" and failed["id"] == "p00001"
    assert report["failed_by_code"] == {"context_length_exceeded": 1}


def test_a_requeue_batch_that_has_not_run_makes_its_prompts_missing_again(
    ledger: Ledger, sink: Sink, tmp_path: Path, cli_env: None, capsys: pytest.CaptureFixture[str]
) -> None:
    job = Job(ledger, sink, tmp_path)
    job.finish(fail={"p00007"})
    job.requeue(["p00007"], run=False)
    to = tmp_path / "e.jsonl"
    code, report, err = reconcile(capsys, "job", "--to", str(to))
    assert code == 1 and not to.exists()
    assert (report["done"], report["failed"], report["missing"]) == (29, 0, 1)
    assert report["missing_ids"] == ["p00007"]
    assert err.startswith("error: job job is not finished: 1 of 30 prompts have no outcome yet")


def test_exporting_a_cancelled_job_says_it_is_cancelled_and_how_to_resume_it(
    ledger: Ledger, sink: Sink, tmp_path: Path, cli_env: None, capsys: pytest.CaptureFixture[str]
) -> None:
    job = Job(ledger, sink, tmp_path)
    job.store_inputs()
    job.run(1)
    job.run(2)
    ledger.jobs.set_state("job", "cancelled", "cancelled by user")
    to = tmp_path / "e.jsonl"
    code, _, err = run_export(capsys, "job", "--to", str(to))
    assert code == 1 and not to.exists()
    assert err == (
        "error: job job is cancelled: 10 of 30 prompts have no outcome yet (e.g. p00020, p00021, "
        "p00022, p00023, p00024); resume it to finish them (python -m producer resume job), or "
        "pass --partial to export what exists\n")
    assert run_export(capsys, "job", "--to", str(to), "--partial")[0] == 0
    assert outcome_ids(read_jsonl(to)) == job.ids[:20]


def test_export_refuses_a_job_whose_enqueue_did_not_finish(
    ledger: Ledger, sink: Sink, tmp_path: Path, cli_env: None, capsys: pytest.CaptureFixture[str]
) -> None:
    job = Job(ledger, sink, tmp_path, prompts=100, complete=False)
    job.store_inputs(upto=3)
    for number in (1, 2, 3):
        job.run(number)
    to = tmp_path / "e.jsonl"
    code, out, err = run_export(capsys, "job", "--to", str(to))
    assert code == 1 and not to.exists() and not list(tmp_path.glob(".e.jsonl*"))
    assert "reconcile: total 100  input 30  done 30  failed 0  missing 70" in out
    assert err.splitlines() == [
        "error: enqueue of job job did not finish: 3 of 10 batch inputs stored; re-run the same "
        "enqueue command, or pass --partial to export what exists"]


def test_a_partial_export_of_an_unfinished_enqueue_writes_what_exists_and_says_what_is_missing(
    ledger: Ledger, sink: Sink, tmp_path: Path, cli_env: None, capsys: pytest.CaptureFixture[str]
) -> None:
    job = Job(ledger, sink, tmp_path, prompts=100, complete=False)
    job.store_inputs(upto=3)
    job.run(1)
    job.run(2, fail={"p00011"})
    to = tmp_path / "e.jsonl"
    code, report, err = reconcile(capsys, "job", "--to", str(to), "--partial")
    assert code == 0
    assert {k: report[k] for k in ("total", "inputs", "done", "failed", "missing")} == {
        "total": 100, "inputs": 30, "done": 19, "failed": 1, "missing": 80}
    assert report["batch_inputs"] == {"stored": 3, "total": 10} and report["written"] == 20
    assert report["missing_ids"][:2] == ["p00020", "p00021"]
    assert outcome_ids(read_jsonl(to)) == job.ids[:20]
    assert "note: enqueue of job job did not finish: 3 of 10 batch inputs stored" in err
    assert "80 prompts missing" in err and "wrote 20 lines" in err


def test_missing_prompts_are_counted_against_the_manifest_not_the_inputs_found(
    ledger: Ledger, sink: Sink, tmp_path: Path, cli_env: None, capsys: pytest.CaptureFixture[str]
) -> None:
    # A manifest written before `complete` existed, of an enqueue that stopped after 2 of 7
    # batch inputs: every stored prompt is done, and the export still refuses.
    job = Job(ledger, sink, tmp_path, prompts=70)
    raw = orjson.loads(job.manifest.to_json())
    del raw["complete"]
    ledger.r.hset(keys.job("job"), "manifest", orjson.dumps(raw))
    job.store_inputs(upto=2)
    job.run(1)
    job.run(2)
    to = tmp_path / "e.jsonl"
    code, report, err = reconcile(capsys, "job", "--to", str(to))
    assert code == 1 and not to.exists()
    assert (report["total"], report["inputs"], report["done"], report["missing"]) == (70, 20, 20, 50)
    assert report["complete"] is True
    assert "error: job job has only 2 of 7 batch inputs stored" in err
    assert "re-run the same enqueue command" in err


def test_export_refuses_an_existing_file_unless_forced(
    ledger: Ledger, sink: Sink, tmp_path: Path, cli_env: None, capsys: pytest.CaptureFixture[str]
) -> None:
    Job(ledger, sink, tmp_path).finish()
    to = tmp_path / "e.jsonl"
    to.write_bytes(b"an earlier dataset\n")
    code, out, err = run_export(capsys, "job", "--to", str(to))
    assert code == 1 and out == ""
    assert err == f"error: --to {to} exists; pass --force to replace it, or choose another file\n"
    assert to.read_bytes() == b"an earlier dataset\n"
    assert run_export(capsys, "job", "--to", str(to), "--force")[0] == 0
    assert len(read_jsonl(to)) == 30


def test_export_refuses_the_jobs_own_input_even_with_force(
    ledger: Ledger, sink: Sink, tmp_path: Path, cli_env: None, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    job = Job(ledger, sink, tmp_path)
    job.finish()
    before = job.source.read_bytes()
    link = tmp_path / "same-file.jsonl"
    os.link(job.source, link)
    for to in (job.source, link):
        code, _, err = run_export(capsys, "job", "--to", str(to), "--force")
        assert code == 1 and "is the job's input file" in err
    # The manifest holds the path as given to enqueue, maybe relative to another folder: the
    # same bytes are the same input.
    raw = orjson.loads(job.manifest.to_json())
    raw["input"]["path"] = job.source.name
    ledger.r.hset(keys.job("job"), "manifest", orjson.dumps(raw))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    code, _, err = run_export(capsys, "job", "--to", str(job.source), "--force")
    assert code == 1 and "is the job's input file (job-prompts.jsonl)" in err
    assert job.source.read_bytes() == before


def test_an_export_that_fails_midway_leaves_no_file_under_its_name(
    ledger: Ledger, sink: Sink, tmp_path: Path, cli_env: None, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    Job(ledger, sink, tmp_path).finish()
    get = LocalSink.get

    def failing_get(self: LocalSink, key: str) -> bytes | None:
        if key.endswith("results/b000003.jsonl"):
            raise SinkError(f"{key}: Input/output error")
        return get(self, key)

    monkeypatch.setattr(LocalSink, "get", failing_get)
    to = tmp_path / "e.jsonl"
    code, _, err = run_export(capsys, "job", "--to", str(to))
    assert code == 1 and "Input/output error" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["job-prompts.jsonl", "out"]


def test_export_reads_the_sink_one_batch_at_a_time(
    ledger: Ledger, sink: Sink, tmp_path: Path, cli_env: None, capsys: pytest.CaptureFixture[str],
) -> None:
    # Python's peak heap while exporting 10 batches and 40 batches of the same size: holding
    # the job (as the export once did) makes the second about four times the first.
    def peak(batches: int) -> int:
        name = f"job{batches}"
        Job(ledger, sink, tmp_path, name, prompts=batches * 20, batch_size=20,
            answer="An answer of about a kilobyte. " * 32).finish(fail={"p00003"})
        tracemalloc.start()
        try:
            assert main(["export", name, "--to", str(tmp_path / f"{name}.jsonl"), "--force"]) == 0
            return tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()

    peak(10)  # imports and connections, paid once
    small, large = peak(10), peak(40)
    capsys.readouterr()
    assert large < 1.5 * small, (small, large)


def test_export_from_s3_streams_the_same_dataset(
    ledger: Ledger, s3_env: dict[str, str], s3_client: Any, s3_server: Any, tmp_path: Path,
    cli_env: None, capsys: pytest.CaptureFixture[str],
) -> None:
    sink = open_sink(f"s3://{s3_server.bucket}/runs")
    job = Job(ledger, sink, tmp_path, prompts=45)
    job.finish(fail={"p00003", "p00040"})
    job.requeue(["p00003", "p00040"], fail={"p00040"})
    job.requeue(["p00003"])  # a late duplicate
    code, report, _ = reconcile(capsys, "job", "--to", str(tmp_path / "s3.jsonl"))
    assert code == 0
    assert {k: report[k] for k in ("total", "inputs", "done", "failed", "failed_by_code",
                                   "missing", "duplicates_dropped")} == {
        "total": 45, "inputs": 45, "done": 44, "failed": 1,
        "failed_by_code": {"context_length_exceeded": 1}, "missing": 0, "duplicates_dropped": 1}
    rows = read_jsonl(tmp_path / "s3.jsonl")
    assert outcome_ids(rows) == job.ids
    assert rows[3]["reasoning_content"] == "thinking in r01-000001"
    # The first line names the S3 store read (here the test's own; AWS itself when no
    # AWS_ENDPOINT_URL is set).
    code, out, _ = run_export(capsys, "job", "--to", str(tmp_path / "s3.jsonl"), "--force")
    assert code == 0 and out.splitlines()[0] == (
        f"reading s3://{s3_server.bucket}/runs/job/ at S3 endpoint {s3_server.endpoint_url}")
    assert rows[40]["custom_id"] == "p00040"

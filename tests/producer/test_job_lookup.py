"""Naming a job and its output: what a command says of a job Redis does not hold, and the output
`enqueue` records for a job.

A job Redis does not hold is a typo unless the output the command reads (its --output, else
$FLEETGEN_OUTPUT, else ./fleetgen-output) holds it; only then is a rebuild worth a word, and a
job that finished there had its keys expire after FLEETGEN_JOB_RETENTION (export still reads it
from its output). An output is recorded as every process will read it back: a folder as its
absolute path, never empty.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest

from fleetgen.ledger import Ledger
from fleetgen.progress import progress_key
from fleetgen.sink import open_sink
from producer.cli import RET_BAD_INPUT, RET_ERROR, RET_OK, main
from tests.producer.test_export import Job
from tests.stack import chat_rows, write_jsonl


@pytest.fixture
def cli(redis_client: Any, cli_env: None) -> Ledger:
    """main() and the Celery app pointed at the test Redis; the ledger on it."""
    return Ledger(redis_client)


def error_of(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    assert main(list(argv)) == RET_ERROR
    return capsys.readouterr().err


def redis_at(ledger: Ledger) -> str:
    kw = ledger.r.connection_pool.connection_kwargs
    return f"Redis at {kw['host']}:{kw['port']}"


def test_a_typo_in_a_job_name_names_the_jobs_command_and_no_data_loss(
    cli: Ledger, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    out = tmp_path / "out"
    Job(cli, open_sink(str(out)), tmp_path, "distill-v1").finish()
    monkeypatch.setenv("FLEETGEN_OUTPUT", str(out))
    expected = (f"error: no job named 'distil-v1' in {redis_at(cli)} (`python -m producer jobs` "
                "lists them)\n")
    for argv in (["status", "distil-v1"], ["pause", "distil-v1"],
                 ["export", "distil-v1", "--to", str(tmp_path / "e.jsonl")]):
        assert error_of(capsys, *argv) == expected


def test_a_job_redis_lost_that_its_output_holds_is_named_with_how_to_rebuild_it(
    cli: Ledger, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    out = tmp_path / "out"
    Job(cli, open_sink(str(out)), tmp_path, "lost").finish()
    cli.r.flushdb()
    to = tmp_path / "e.jsonl"
    hint = (f"{out / 'lost'} holds job lost: if Redis lost its data, `python -m producer rebuild "
            f"lost --output {out}` puts it back (`python -m producer export lost --to FILE "
            f"--output {out}` reads the output alone)\n")
    # The output given to the command, or $FLEETGEN_OUTPUT's.
    assert error_of(capsys, "rebuild", "lost", "--output", str(tmp_path / "elsewhere")) == (
        f"error: no job lost in {tmp_path / 'elsewhere'}: {tmp_path / 'elsewhere' / 'lost'}"
        "/manifest.json does not exist\n")
    monkeypatch.setenv("FLEETGEN_OUTPUT", str(out))
    for argv in (["status", "lost"], ["export", "lost", "--to", str(to)]):
        err = error_of(capsys, *argv)
        assert err == (f"error: no job named 'lost' in {redis_at(cli)} (`python -m producer jobs` "
                       f"lists them)\n{hint}")
    assert main(["export", "lost", "--to", str(to), "--output", str(out)]) == RET_OK


def test_a_finished_job_whose_keys_expired_says_so_and_that_export_still_reads_it(
    cli: Ledger, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    out = tmp_path / "out"
    sink = open_sink(str(out))
    Job(cli, sink, tmp_path, "old").finish()
    # The progress.json the reconciler last wrote of the finished job.
    sink.put(progress_key("old"), orjson.dumps({"job": "old", "state": "done", "reason": None}))
    cli.r.flushdb()  # what retention does to a finished job's keys
    monkeypatch.setenv("FLEETGEN_OUTPUT", str(out))
    err = error_of(capsys, "status", "old")
    assert err.splitlines()[1] == (
        f"{out / 'old'} holds job old, which finished (done): Redis forgets a finished job "
        "FLEETGEN_JOB_RETENTION after it finished, and its output keeps it all; `python -m "
        f"producer export old --to FILE --output {out}` exports it")
    assert "rebuild" not in err


def test_enqueue_records_a_relative_output_folder_as_its_absolute_path(
    cli: Ledger, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    source = write_jsonl(tmp_path / "prompts.jsonl", chat_rows(4))
    monkeypatch.chdir(tmp_path)
    assert main(["enqueue", str(source), "--job", "rel", "--output", "runs"]) == RET_OK
    assert f"output {tmp_path / 'runs'}" in capsys.readouterr().out
    manifest = cli.jobs.load("rel")
    assert manifest.output == str(tmp_path / "runs")
    stored = orjson.loads((tmp_path / "runs" / "rel" / "manifest.json").read_bytes())
    assert stored["output"] == str(tmp_path / "runs")
    # Another folder's process reads the same output; the relative name is still accepted.
    monkeypatch.chdir(tmp_path / "runs")
    to = tmp_path / "e.jsonl"
    assert main(["export", "rel", "--to", str(to), "--partial", "--output", "../runs"]) == RET_OK


def test_enqueue_refuses_an_empty_output(
    cli: Ledger, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    source = write_jsonl(tmp_path / "prompts.jsonl", chat_rows(4))
    monkeypatch.chdir(tmp_path)
    assert main(["enqueue", str(source), "--job", "empty", "--output", ""]) == RET_BAD_INPUT
    assert capsys.readouterr().err == (
        "error: --output is empty: give s3://bucket/prefix or a folder, or leave it out for "
        "$FLEETGEN_OUTPUT, else ./fleetgen-output\n")
    assert not cli.jobs.exists("empty") and not (tmp_path / "fleetgen-output").exists()

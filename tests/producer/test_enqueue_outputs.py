"""Outputs that cannot overlap (producer/enqueue.py `_check_output`, fleetgen/sink.py): a job's
folder `{output}/{job}/` may not lie inside another job's, nor hold one, nor be named like what
every job keeps in its folder; and a folder and an S3 sink list the same keys, one level deep.

Before, `enqueue --job results --output OUT/a` put a job inside job a's `results/`: with a
folder output `requeue --failed a` crashed with KeyError 'id' (the other job's rejects.jsonl
read as a's results), and on S3, whose listing was recursive, it said "Nothing to do" while
export counted a's failures (the other job's inputs read as a's answers).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest

from fleetgen import keys
from fleetgen.ledger import Ledger
from fleetgen.records import Origin, error_record, result_record, written_counts
from fleetgen.sink import Sink, location, open_sink
from launcher.services import S3Server
from producer.cli import RET_ERROR, RET_OK, main
from tests.stack import chat_rows, write_jsonl

FAILED = 5


@pytest.fixture
def cli(redis_client: Any, cli_env: None) -> Any:
    """main() and the Celery app pointed at the test Redis; yields its (flushed) client."""
    return redis_client


@pytest.fixture(params=["folder", "s3"])
def output(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """Where the jobs write: a folder, or a prefix of the test S3 (emptied around the test)."""
    if request.param == "folder":
        return str(tmp_path / "out")
    request.getfixturevalue("s3_env")
    request.getfixturevalue("s3_client")
    server: S3Server = request.getfixturevalue("s3_server")
    return f"s3://{server.bucket}/runs"


def enqueue(source: Path, job: str, output: str, *flags: str) -> int:
    return main(["enqueue", str(source), "--job", job, "--output", output, *flags])


def write_outcomes(ledger: Ledger, sink: Sink, job: str, failed: int) -> None:
    """Every batch of `job` written, as workers would: its first `failed` prompts failed."""
    origin = Origin(server="http://sim", worker="gpu0@test", attempt=1)
    left = failed
    for batch in ledger.jobs.batches(job):
        results, errors = [], []
        for line in (sink.get(keys.sink_input(job, batch)) or b"").splitlines():
            row = orjson.loads(line)
            if left:
                left -= 1
                errors.append(error_record(row["id"], row["line"], "HTTP 400: too long", 400,
                                           origin, tries=1))
            else:
                answer = {"choices": [{"message": {"content": "ok"}, "finish_reason": "stop"}]}
                results.append(result_record(row["id"], row["line"], answer, 1.0, origin))
        if errors:
            sink.put_new(keys.sink_errors(job, batch), b"".join(orjson.dumps(e) + b"\n" for e in errors))
        sink.put_new(keys.sink_result(job, batch), b"".join(orjson.dumps(r) + b"\n" for r in results))
        ledger.batches.finish_and_settle(job, batch, written_counts(errors + results),
                                         origin.worker, [])


def test_a_job_refused_inside_another_jobs_folder_leaves_requeue_failed_working(
    cli: Any, output: str, tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    prompts = write_jsonl(tmp_path / "in.jsonl", chat_rows(20))
    assert enqueue(prompts, "a", output, "--batch-size", "10") == RET_OK
    write_outcomes(Ledger(cli), open_sink(output), "a", FAILED)
    # The same prompts plus a bad line, into job a's folder, under the name of a's results.
    mixed = write_jsonl(tmp_path / "mixed.jsonl", [*chat_rows(20), {"id": "bad"}])
    capsys.readouterr()
    inside = f"{output}/a"
    assert enqueue(mixed, "r", inside, "--skip-invalid") == RET_ERROR
    err = capsys.readouterr().err
    mine, theirs = location(inside) + "r/", location(output) + "a/"
    assert err == (f"error: --output {inside} puts job 'r' at {mine}, inside job 'a' at "
                   f"{theirs}; choose an --output outside every job's folder\n")
    assert not cli.exists(keys.job("r"))
    # A name like a job's own folder is refused whatever the output.
    assert enqueue(mixed, "results", inside, "--skip-invalid") == RET_ERROR
    assert "job name 'results'" in capsys.readouterr().err
    assert main(["requeue", "a", "--failed"]) == RET_OK
    assert capsys.readouterr().out.startswith(f"job a: requeued {FAILED} failed prompts in 1 ")


@pytest.mark.parametrize("name", [*keys.JOB_ENTRIES[:-1], "Results", "ERRORS"])
def test_a_job_named_like_what_every_job_keeps_in_its_folder_is_refused(
    cli: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str,
) -> None:
    prompts = write_jsonl(tmp_path / "in.jsonl", chat_rows(3))
    assert enqueue(prompts, name, str(tmp_path / "out")) == RET_ERROR
    err = capsys.readouterr().err
    assert err.startswith(f"error: job name {name!r}: every job keeps its own") and err.count("\n") == 1
    assert cli.dbsize() == 0 and not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("first", "second", "where"),
    [
        (("a", "out"), ("b", "out/a"), "inside"),
        (("a", "out"), ("b", "out/a/results/deep"), "inside"),
        (("a", "out"), ("b", "out/a/"), "inside"),
        (("a", "out/x"), ("x", "out"), "around"),
        (("a", "out/x/y/z"), ("x", "out/."), "around"),
    ],
    ids=["output-is-the-job-folder", "deeper", "trailing-slash", "holds-it", "holds-it-deeper"],
)
def test_a_job_whose_folder_overlaps_a_known_jobs_folder_is_refused_naming_both(
    cli: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    first: tuple[str, str], second: tuple[str, str], where: str,
) -> None:
    prompts = write_jsonl(tmp_path / "in.jsonl", chat_rows(3))
    assert enqueue(prompts, first[0], str(tmp_path / first[1])) == RET_OK
    capsys.readouterr()
    assert enqueue(prompts, second[0], str(tmp_path / second[1])) == RET_ERROR
    err = capsys.readouterr().err
    mine = f"{(tmp_path / second[1]).resolve()}/{second[0]}/"
    theirs = f"{(tmp_path / first[1]).resolve()}/{first[0]}/"
    assert f"puts job {second[0]!r} at {mine}, {where} job {first[0]!r} at {theirs};" in err
    assert err.count("\n") == 1 and not cli.exists(keys.job(second[0]))


def test_a_job_redis_no_longer_knows_is_found_by_its_manifest_above_the_output(
    cli: Any, output: str, tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    prompts = write_jsonl(tmp_path / "in.jsonl", chat_rows(3))
    assert enqueue(prompts, "a", output) == RET_OK
    cli.flushdb()  # Redis lost it, or its keys expired: the sink still holds it
    capsys.readouterr()
    assert enqueue(prompts, "b", f"{output}/a/sub") == RET_ERROR
    err = capsys.readouterr().err
    assert (f"puts job 'b' at {location(output)}a/sub/b/, inside job 'a' at "
            f"{location(output)}a/ (its manifest.json is there)") in err
    assert not cli.exists(keys.job("b"))


def test_another_tools_manifest_above_the_output_and_sibling_jobs_are_no_overlap(
    cli: Any, tmp_path: Path,
) -> None:
    (tmp_path / "out").mkdir()
    (tmp_path / "manifest.json").write_bytes(b'{"name": "some build"}')
    (tmp_path / "out/manifest.json").write_bytes(b"not json")
    prompts = write_jsonl(tmp_path / "in.jsonl", chat_rows(3))
    assert enqueue(prompts, "a", str(tmp_path / "out")) == RET_OK
    assert enqueue(prompts, "ab", str(tmp_path / "out")) == RET_OK  # a prefix of the name only
    assert enqueue(prompts, "a", str(tmp_path / "out")) == RET_OK  # the same job resumes


def test_a_bad_job_name_is_still_a_bad_input_before_its_output_is_looked_at(
    cli: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    prompts = write_jsonl(tmp_path / "in.jsonl", chat_rows(3))
    assert enqueue(prompts, "../up", "s3:///no-bucket") == RET_ERROR
    assert "job name '../up'" in capsys.readouterr().err


KEYS = ["job/manifest.json", "job/progress.json", "job/results/b000001.jsonl",
        "job/results/b000002.jsonl", "job/results/results/manifest.json",
        "job/results/results/inputs/b000001.jsonl", "job/results/x/y/z.jsonl",
        "job/resume.txt", "top.jsonl"]


@pytest.mark.parametrize(
    ("prefix", "expected"),
    [
        ("job/results/", ["job/results/b000001.jsonl", "job/results/b000002.jsonl"]),
        ("job/results/b", ["job/results/b000001.jsonl", "job/results/b000002.jsonl"]),
        ("job/results/b000002.jsonl", ["job/results/b000002.jsonl"]),
        ("job/", ["job/manifest.json", "job/progress.json", "job/resume.txt"]),
        ("job/res", ["job/resume.txt"]),
        ("", ["top.jsonl"]),
        ("job/errors/", []),
    ],
)
def test_a_folder_and_an_s3_sink_list_the_same_keys_one_level_deep(
    tmp_path: Path, s3_env: dict[str, str], s3_server: S3Server, s3_client: Any,
    prefix: str, expected: list[str],
) -> None:
    sinks = [open_sink(str(tmp_path / "out")), open_sink(f"s3://{s3_server.bucket}/runs")]
    for sink in sinks:
        for key in KEYS:
            sink.put(key, b"{}\n")
    listed = [list(sink.list_keys(prefix)) for sink in sinks]
    assert listed == [expected, expected]

"""`python -m producer upload`: a local file put into the test S3 with the producer's own
endpoint and credentials, then read back with boto3 and enqueued from there; and what it
refuses before anything is written (a missing file, a target that is not S3, a missing
bucket, an object already there)."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest

from fleetgen.ledger import Ledger
from launcher.services import S3Server
from producer.cli import RET_BAD_INPUT, RET_OK, main
from tests.stack import PYTHON, ROOT, chat_rows, write_jsonl


@pytest.fixture
def bucket(s3_env: dict[str, str], s3_server: S3Server, s3_client: Any) -> str:
    """The test S3's bucket, emptied around the test, with AWS_* pointing main() at it."""
    return s3_server.bucket


def objects(client: Any, bucket: str) -> dict[str, bytes]:
    listed = client.list_objects_v2(Bucket=bucket).get("Contents", [])
    return {o["Key"]: client.get_object(Bucket=bucket, Key=o["Key"])["Body"].read()
            for o in listed}


def test_a_file_uploaded_to_a_prefix_keeps_its_name_and_is_enqueued_from_there(
    bucket: str, s3_client: Any, tmp_path: Path, redis_client: Any, cli_env: None,
    capsys: pytest.CaptureFixture[str],
) -> None:
    src = write_jsonl(tmp_path / "prompts.jsonl", chat_rows(30))
    size = src.stat().st_size

    assert main(["upload", str(src), f"s3://{bucket}/prompts/"]) == RET_OK
    out = capsys.readouterr().out
    uri = f"s3://{bucket}/prompts/prompts.jsonl"
    assert f"wrote {uri} ({size:,} bytes) from {src} at S3 endpoint http://127.0.0.1:" in out
    assert objects(s3_client, bucket) == {"prompts/prompts.jsonl": src.read_bytes()}

    assert main(["enqueue", uri, "--job", "from-s3", "--output", f"s3://{bucket}/runs",
                 "--batch-size", "10", "--no-canary"]) == RET_OK
    assert "job from-s3 created: 30 prompts in 3 batches" in capsys.readouterr().out
    manifest = Ledger(redis_client).jobs.load("from-s3")
    assert manifest.input.path == uri and manifest.prompts == 30


def test_a_file_uploaded_to_a_key_is_written_there_and_several_files_go_to_a_prefix(
    bucket: str, s3_client: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    one = write_jsonl(tmp_path / "a.jsonl", chat_rows(2))
    two = write_jsonl(tmp_path / "b.jsonl", chat_rows(3))
    assert main(["upload", str(one), f"s3://{bucket}/in/mine.jsonl"]) == RET_OK
    assert main(["upload", str(one), str(two), f"s3://{bucket}"]) == RET_OK
    assert objects(s3_client, bucket) == {"in/mine.jsonl": one.read_bytes(),
                                          "a.jsonl": one.read_bytes(), "b.jsonl": two.read_bytes()}
    out = capsys.readouterr().out
    assert f"wrote s3://{bucket}/a.jsonl" in out and f"wrote s3://{bucket}/b.jsonl" in out


@pytest.mark.parametrize(("target", "why"), [
    ("s3://{bucket}/in/", "error: {missing}: no such file"),
    ("/tmp/prompts/", "error: /tmp/prompts/: upload writes to S3: give s3://bucket/prefix/ "
     "(each file keeps its name) or s3://bucket/key"),
    ("s3:///key", "error: s3:///key: upload writes to S3"),
])
def test_a_missing_file_or_a_target_that_is_not_s3_is_refused_and_nothing_is_written(
    bucket: str, s3_client: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    target: str, why: str,
) -> None:
    present = write_jsonl(tmp_path / "a.jsonl", chat_rows(2))
    missing = tmp_path / "gone.jsonl"
    files = [str(present), str(missing)] if "{missing}" in why else [str(present)]
    code = main(["upload", *files, target.format(bucket=bucket)])
    assert code == RET_BAD_INPUT
    assert capsys.readouterr().err.startswith(why.format(missing=missing))
    assert objects(s3_client, bucket) == {}


def test_several_files_to_one_key_or_a_folder_are_refused_saying_what_to_give(
    bucket: str, tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    one = write_jsonl(tmp_path / "a.jsonl", chat_rows(2))
    assert main(["upload", str(one), str(one), f"s3://{bucket}/in/x.jsonl"]) == RET_BAD_INPUT
    assert (f"error: s3://{bucket}/in/x.jsonl is one object's key, for one file: end it with / "
            "to put the 2 files under it") in capsys.readouterr().err
    assert main(["upload", str(tmp_path), f"s3://{bucket}/in/"]) == RET_BAD_INPUT
    assert (f"error: {tmp_path}: a folder; upload its files to a prefix, e.g. `python -m "
            f"producer upload {tmp_path}/* s3://bucket/prefix/`") in capsys.readouterr().err


def test_a_missing_bucket_is_named_with_the_command_that_creates_it_in_the_embedded_s3(
    bucket: str, s3_server: S3Server, tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    one = write_jsonl(tmp_path / "a.jsonl", chat_rows(2))
    assert main(["upload", str(one), "s3://no-such-bucket/in/"]) == RET_BAD_INPUT
    err = capsys.readouterr().err
    assert err.startswith(f"error: s3://no-such-bucket at {s3_server.endpoint_url}: no such bucket")
    assert err.rstrip().endswith("the embedded S3 creates its bucket when it starts: "
                                 "`python -m launcher s3 --bucket no-such-bucket`")


def test_an_object_that_exists_is_replaced_only_with_force(
    bucket: str, s3_client: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    (tmp_path / "first").mkdir()
    (tmp_path / "second").mkdir()
    first = write_jsonl(tmp_path / "first" / "p.jsonl", chat_rows(2))
    second = write_jsonl(tmp_path / "second" / "p.jsonl", chat_rows(5))
    assert main(["upload", str(first), f"s3://{bucket}/in/"]) == RET_OK
    assert main(["upload", str(second), f"s3://{bucket}/in/"]) == RET_BAD_INPUT
    assert (f"error: s3://{bucket}/in/p.jsonl exists: pass --force to replace it, or upload to "
            "another key") in capsys.readouterr().err
    assert objects(s3_client, bucket) == {"in/p.jsonl": first.read_bytes()}
    assert main(["upload", str(second), f"s3://{bucket}/in/", "--force"]) == RET_OK
    assert objects(s3_client, bucket) == {"in/p.jsonl": second.read_bytes()}


@pytest.mark.e2e
def test_python_m_producer_upload_reads_the_s3_settings_from_the_environment(
    bucket: str, s3_env: dict[str, str], s3_client: Any, tmp_path: Path,
) -> None:
    src = write_jsonl(tmp_path / "prompts.jsonl", chat_rows(3))
    done = subprocess.run(
        [PYTHON, "-m", "producer", "upload", str(src), f"s3://{bucket}/prompts/"],
        cwd=ROOT, env={"PATH": "/usr/bin:/bin", **s3_env}, capture_output=True, text=True,
        timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"wrote s3://{bucket}/prompts/prompts.jsonl")
    assert objects(s3_client, bucket) == {"prompts/prompts.jsonl": src.read_bytes()}

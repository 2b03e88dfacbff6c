"""The sink's contract (fleetgen/sink.py) on a folder and on a real S3 (SeaweedFS): a write is
create-if-absent, a missing object reads as None, and every other failure is a SinkError
naming the object, never a botocore or OS exception (the batch runner and export catch only
SinkError, and a late duplicate writer must be a no-op, never an overwrite)."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import boto3
import pytest

from fleetgen.errors import SinkError
from fleetgen.retry import on_sink
from fleetgen.sink import S3Sink, open_sink
from launcher.services import S3Server


def test_a_folder_sink_writes_once_and_a_late_writer_is_a_no_op(tmp_path: Path) -> None:
    sink = open_sink(f"file://{tmp_path}/out")
    assert sink.put_new("job/results/b1.jsonl", b"first\n")
    assert not sink.put_new("job/results/b1.jsonl", b"second\n")
    assert sink.get("job/results/b1.jsonl") == b"first\n"
    assert sink.get("job/results/b2.jsonl") is None and not sink.exists("job/results/b2.jsonl")
    # Neither write leaves its temporary file behind, nor does a listing show one.
    assert [p.name for p in (tmp_path / "out/job/results").iterdir()] == ["b1.jsonl"]
    assert list(sink.list_keys("job/results/")) == ["job/results/b1.jsonl"]


def test_a_folder_that_cannot_be_written_or_read_raises_sink_error_naming_the_path(
        tmp_path: Path) -> None:
    (tmp_path / "out").mkdir()
    (tmp_path / "out/job").write_bytes(b"a file where the job's folder should be")
    sink = open_sink(str(tmp_path / "out"))
    with pytest.raises(SinkError, match=str(tmp_path / "out/job/results/b1.jsonl")):
        sink.put_new("job/results/b1.jsonl", b"x")
    with pytest.raises(SinkError, match="job/progress.json"):
        sink.put("job/progress.json", b"{}")
    (tmp_path / "out/dir.jsonl").mkdir()
    with pytest.raises(SinkError, match="dir.jsonl"):
        sink.get("dir.jsonl")


def test_an_output_with_no_bucket_or_an_unknown_scheme_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SinkError, match="needs a bucket"):
        open_sink("s3:///runs")
    with pytest.raises(SinkError, match="unsupported output scheme 'gs'"):
        open_sink("gs://bucket/runs")


def test_an_s3_sink_writes_once_and_reads_a_missing_object_as_none(
        s3_env: dict[str, str], s3_server: S3Server, s3_client: Any) -> None:
    sink = open_sink(f"s3://{s3_server.bucket}/runs")
    assert sink.put_new("job/results/b1.jsonl", b"first\n")
    assert not sink.put_new("job/results/b1.jsonl", b"second\n")  # 412: already there
    assert sink.get("job/results/b1.jsonl") == b"first\n"
    assert sink.get("job/results/b2.jsonl") is None and not sink.exists("job/results/b2.jsonl")
    assert list(sink.list_keys("job/results/")) == ["job/results/b1.jsonl"]
    assert sink.describe("job/x") == f"s3://{s3_server.bucket}/runs/job/x"


def test_a_missing_bucket_and_refused_credentials_are_told_apart(
        s3_env: dict[str, str], s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(SinkError, match="no such bucket"):
        open_sink("s3://no-such-bucket-here/runs")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    monkeypatch.setattr(boto3, "DEFAULT_SESSION", None)  # it caches the credentials it read
    with pytest.raises(SinkError, match="access denied"):
        open_sink(f"s3://{s3_server.bucket}/runs")
    # Refused after the sink was opened: a write is an error, not "already there".
    sink = S3Sink(f"s3://{s3_server.bucket}/runs", s3_server.bucket, "runs", "path")
    for call in (lambda: sink.put_new("k", b"x"), lambda: sink.get("k"), lambda: sink.exists("k")):
        with pytest.raises(SinkError, match=f"s3://{s3_server.bucket}/runs/k: "):
            call()


@pytest.fixture
def unreachable(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every S3 request fails before it is sent, as a socket error (no botocore retry)."""
    session = boto3.session.Session()

    def refuse(**_: Any) -> None:
        raise ConnectionRefusedError(111, "Connection refused")

    session.events.register("before-send.s3", refuse)
    monkeypatch.setattr(boto3, "DEFAULT_SESSION", session)


def test_any_other_failure_of_s3_is_a_sink_error_naming_the_object(
        s3_env: dict[str, str], s3_server: S3Server, unreachable: None) -> None:
    with pytest.raises(SinkError, match=f"s3://{s3_server.bucket} at .*refused"):
        open_sink(f"s3://{s3_server.bucket}/runs")
    sink = S3Sink(f"s3://{s3_server.bucket}/runs", s3_server.bucket, "runs", "path")
    calls = [lambda: sink.put_new("k", b"x"), lambda: sink.put("k", b"x"),
             lambda: sink.put_file("k", io.BytesIO(b"x")), lambda: sink.get("k"),
             lambda: sink.exists("k"), lambda: list(sink.list_keys("k"))]
    for call in calls:
        with pytest.raises(SinkError, match=f"s3://{s3_server.bucket}/runs/k"):
            call()


@pytest.fixture
def plain_aws(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A shell with no AWS variable set, no AWS files and no instance metadata: what a new
    user's machine has. boto3 then goes to AWS itself, and finds no credentials before it
    sends anything."""
    for name in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_ACCESS_KEY_ID",
                 "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_REGION"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    # A fresh boto3 session: the default one keeps the credentials an earlier test found.
    monkeypatch.setattr(boto3, "DEFAULT_SESSION", None)


def test_an_s3_output_without_an_endpoint_or_credentials_says_it_is_aws_and_none_were_found(
        plain_aws: None) -> None:
    with pytest.raises(SinkError) as caught:
        open_sink("s3://my-bucket/runs")
    assert str(caught.value) == (
        "s3://my-bucket at AWS (https://s3.amazonaws.com; AWS_ENDPOINT_URL is not set to another "
        "S3 store): no credentials (set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or "
        "AWS_PROFILE)")


def test_on_sink_rides_out_errors_until_its_deadline() -> None:
    failures = [SinkError("down"), SinkError("still down")]

    def flaky() -> str:
        if failures:
            raise failures.pop(0)
        return "written"

    assert on_sink(flaky, deadline_s=5) == "written"
    calls = []

    def down() -> None:
        calls.append(1)
        raise SinkError("down")

    with pytest.raises(SinkError, match="down"):
        on_sink(down, deadline_s=0.05)
    assert len(calls) >= 1
    with pytest.raises(OSError):  # only SinkError is ridden out
        on_sink(lambda: (_ for _ in ()).throw(OSError("a bug")), deadline_s=5)

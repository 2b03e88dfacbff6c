"""End to end on real parts: a job enqueued from Parquet, a saved Hugging Face dataset, a folder
of shards and S3 objects runs on a simulated server and exports every prompt exactly once."""

from __future__ import annotations

import collections
from pathlib import Path
from typing import Any

import orjson
import pytest

from launcher.services import S3Server
from tests.stack import Stack, chat_rows, save_dataset, wait_job_done, write_jsonl, write_parquet

pytestmark = pytest.mark.e2e

SIM_FLAGS = ("--decode-tps", "200", "--mean-output-tokens", "50", "--speed", "50")
PROMPTS = 40


def _columns(n: int) -> dict[str, list[Any]]:
    ids = [f"q{i:03d}" for i in range(n)]
    return {"qid": ids, "question": [f"What is {i} plus {i}?" for i in range(n)],
            "answer": [str(2 * i) for i in range(n)]}


def _input(kind: str, tmp_path: Path, s3_client: Any, bucket: str) -> str:
    columns = _columns(PROMPTS)
    if kind == "parquet":
        return str(write_parquet(tmp_path / "q.parquet", columns, row_group_rows=7))
    if kind == "dataset":
        return str(save_dataset(tmp_path / "ds", columns, shards=3))
    half = PROMPTS // 2
    first = write_parquet(tmp_path / "a.parquet", {k: v[:half] for k, v in columns.items()})
    second = write_parquet(tmp_path / "b.parquet", {k: v[half:] for k, v in columns.items()})
    if kind == "folder":
        folder = tmp_path / "shards"
        folder.mkdir()
        first.rename(folder / "part-0.parquet")
        second.rename(folder / "part-1.parquet")
        return str(folder)
    s3_client.upload_file(str(first), bucket, "prompts/part-0.parquet")
    s3_client.upload_file(str(second), bucket, "prompts/part-1.parquet")
    return f"s3://{bucket}/prompts/"


@pytest.mark.parametrize("kind", ["parquet", "dataset", "folder", "s3-shards"])
def test_a_table_input_is_enqueued_and_exported_exactly_once(
    stack: Stack, tmp_path: Path, s3_server: S3Server, s3_client: Any, kind: str,
) -> None:
    source = _input(kind, tmp_path, s3_client, s3_server.bucket)
    _, url = stack.sim("sim0", *SIM_FLAGS)
    stack.worker(0, url)
    out = stack.producer("enqueue", source, "--job", "table", "--output",
                         f"s3://{s3_server.bucket}/runs", "--prompt-column", "question",
                         "--id-column", "qid", "--batch-size", "8")
    assert f"{PROMPTS} prompts" in out.stdout
    assert "columns passed over (no prompt field): answer" in out.stdout
    wait_job_done(stack, "table", timeout=120)
    exported = tmp_path / "out.jsonl"
    stack.producer("export", "table", "--to", str(exported))
    rows = [orjson.loads(line) for line in exported.read_bytes().splitlines()]
    counts = collections.Counter(r["id"] for r in rows)
    assert set(counts) == set(_columns(PROMPTS)["qid"]) and max(counts.values()) == 1
    again = stack.producer("enqueue", source, "--job", "table", "--output",
                           f"s3://{s3_server.bucket}/runs", "--prompt-column", "question",
                           "--id-column", "qid")
    assert "job table resumed" in again.stdout and "enqueued 0 batches" in again.stdout


def test_an_s3_jsonl_input_runs_and_a_changed_object_is_refused_as_another_input(
    stack: Stack, tmp_path: Path, s3_server: S3Server, s3_client: Any,
) -> None:
    rows = chat_rows(30)
    local = write_jsonl(tmp_path / "p.jsonl", rows)
    s3_client.upload_file(str(local), s3_server.bucket, "in/p.jsonl")
    source = f"s3://{s3_server.bucket}/in/p.jsonl"
    args = ("enqueue", source, "--job", "from-s3", "--output", str(tmp_path / "out"))
    _, url = stack.sim("sim0", *SIM_FLAGS)
    stack.worker(0, url)
    assert "30 prompts" in stack.producer(*args).stdout
    wait_job_done(stack, "from-s3", timeout=120)
    manifest = orjson.loads((tmp_path / "out/from-s3/manifest.json").read_bytes())
    assert manifest["input"]["path"] == source
    s3_client.upload_file(str(write_jsonl(tmp_path / "q.jsonl", rows[:29])), s3_server.bucket,
                          "in/p.jsonl")
    refused = stack.producer(*args, check=False)
    assert refused.returncode == 1
    assert (f"job 'from-s3' was enqueued from a different input ({source}, sha256 "
            f"{manifest['input']['sha256'][:12]})") in refused.stderr


def test_bad_rows_stop_enqueue_naming_file_row_and_column(
    stack: Stack, tmp_path: Path, redis_client: Any,
) -> None:
    path = write_parquet(tmp_path / "bad.parquet", {
        "id": ["a", "b", "c"], "prompt": ["fine", "", "fine too"],
        "sampling": [None, None, {"top_p": 0.0}]})
    result = stack.producer("enqueue", str(path), "--job", "bad", "--output",
                            str(tmp_path / "out"), check=False)
    assert result.returncode == 2
    assert result.stderr.splitlines()[0] == (
        f'{path}: row 2: column prompt: expected a non-empty string; got ""')
    assert result.stderr.splitlines()[1] == (
        f"{path}: row 3: column sampling.top_p: expected a number in (0, 1]; got 0.0")
    assert not (tmp_path / "out").exists() and redis_client.dbsize() == 0

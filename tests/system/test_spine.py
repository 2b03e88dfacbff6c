"""End to end on real parts: Valkey, SeaweedFS, simulated SGLang servers, Celery worker processes."""

from __future__ import annotations

import collections
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from fleetgen import broker, keys
from fleetgen.ledger import Ledger
from tests.stack import (
    Stack,
    chat_rows,
    iter_ids,
    queue_depth,
    read_results,
    wait_job_done,
    write_jsonl,
)

pytestmark = pytest.mark.e2e

SIM_FLAGS = ("--max-running-requests", "8", "--decode-tps", "80", "--mean-output-tokens", "300",
             "--speed", "50")


def _ids_once(results: list[dict[str, Any]], errors: list[dict[str, Any]]) -> collections.Counter[str]:
    return collections.Counter([r["id"] for r in results] + [e["custom_id"] for e in errors])


def test_500_prompts_through_two_workers_land_exactly_once_in_s3(stack: Stack, tmp_path: Path,
                                                                   s3_server: Any) -> None:
    rows = chat_rows(500)
    src = write_jsonl(tmp_path / "prompts.jsonl", rows)
    _, url0 = stack.sim("sim0", *SIM_FLAGS)
    _, url1 = stack.sim("sim1", *SIM_FLAGS)
    stack.worker(0, url0)
    stack.worker(1, url1)
    out = stack.producer("enqueue", str(src), "--job", "five-hundred",
                         "--output", f"s3://{s3_server.bucket}/runs", "--max-tokens", "2000")
    assert "500 prompts" in out.stdout
    status = wait_job_done(stack, "five-hundred", timeout=240)
    assert status.done == 500 and status.failed == 0

    import boto3

    s3 = boto3.client("s3", endpoint_url=s3_server.endpoint_url, region_name="us-east-1",
                      aws_access_key_id=s3_server.access_key, aws_secret_access_key=s3_server.secret_key)
    listing = s3.list_objects_v2(Bucket=s3_server.bucket, Prefix="runs/five-hundred/results/")
    results = [orjson.loads(line) for obj in listing["Contents"]
               for line in s3.get_object(Bucket=s3_server.bucket, Key=obj["Key"])["Body"].read().splitlines()]
    counts = _ids_once(results, [])
    assert set(counts) == set(iter_ids(rows))
    assert max(counts.values()) == 1
    assert {r["worker"] for r in results} == {"gpu0@test", "gpu1@test"}
    # What was stored is what the server produced for that request (the simulator is deterministic).
    sample = next(r for r in results if r["id"] == "p00007")
    manifest = orjson.loads(s3.get_object(Bucket=s3_server.bucket,
                                          Key="runs/five-hundred/manifest.json")["Body"].read())
    body = {**_body_of(s3, s3_server.bucket, "runs/five-hundred", "p00007")}
    direct = httpx.post(f"{url0}/v1/chat/completions", json=body, timeout=60).json()
    assert sample["content"] == direct["choices"][0]["message"]["content"]
    assert sample["reasoning_content"] == direct["choices"][0]["message"]["reasoning_content"]
    assert sample["reasoning_content"] and sample["content"]
    assert manifest["prompts"] == 500


def _body_of(s3: Any, bucket: str, prefix: str, prompt_id: str) -> dict[str, Any]:
    listing = s3.list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/inputs/")
    for obj in listing["Contents"]:
        for line in s3.get_object(Bucket=bucket, Key=obj["Key"])["Body"].read().splitlines():
            row = orjson.loads(line)
            if row["id"] == prompt_id:
                return dict(row["body"])
    raise AssertionError(f"{prompt_id} not in inputs")


@pytest.mark.parametrize(
    ("line", "field"),
    [
        (b'{"id": "a", "messages": [}', "json"),
        (b'{"id": "a", "messages": []}', "messages"),
        (b'{"id": "a", "messages": [{"role": "bot", "content": "x"}]}', "messages[0].role"),
        (b'{"id": "a", "prompt": 7}', "prompt"),
        (b'{"id": "a", "messages": [{"role": "user", "content": "\xff\xfe"}]}', "utf-8"),
    ],
)
def test_a_bad_line_stops_enqueue_before_anything_is_queued(
    stack: Stack, tmp_path: Path, redis_client: Any, line: bytes, field: str
) -> None:
    good = b"".join(orjson.dumps(r) + b"\n" for r in chat_rows(5))
    src = tmp_path / "bad.jsonl"
    src.write_bytes(good + line + b"\n" + good.replace(b'"p0', b'"q0'))
    result = stack.producer("enqueue", str(src), "--job", "bad", "--output", str(tmp_path / "out"),
                            check=False)
    assert result.returncode == 2
    assert "bad.jsonl:6:" in result.stderr
    assert field.split("[")[0].lower() in result.stderr.lower()
    assert not (tmp_path / "out").exists()
    assert queue_depth(redis_client, keys.SHARED_QUEUE) == 0
    assert not redis_client.exists(keys.job("bad"))


def test_skip_invalid_enqueues_the_rest_and_writes_rejects_with_reasons(
    stack: Stack, tmp_path: Path, redis_client: Any
) -> None:
    src = tmp_path / "mixed.jsonl"
    src.write_bytes(b'{"id": "ok1", "prompt": "hi"}\n{"id": "bad", "messages": "nope"}\n'
                    b'{"id": "ok2", "prompt": "there"}\n')
    out = stack.producer("enqueue", str(src), "--job", "mixed", "--output", str(tmp_path / "out"),
                         "--skip-invalid")
    assert "rejected 1" in out.stdout
    rejects = [orjson.loads(x) for x in (tmp_path / "out/mixed/rejects.jsonl").read_bytes().splitlines()]
    assert rejects[0]["line"] == 2 and rejects[0]["field"] == "messages"
    inputs = b"".join(p.read_bytes() for p in (tmp_path / "out/mixed/inputs").glob("*.jsonl"))
    assert {orjson.loads(x)["id"] for x in inputs.splitlines()} == {"ok1", "ok2"}


def test_rerunning_enqueue_resumes_only_what_is_neither_done_nor_queued(
    stack: Stack, tmp_path: Path, redis_client: Any, celery_app: Any
) -> None:
    src = write_jsonl(tmp_path / "p.jsonl", chat_rows(60))
    out_dir = tmp_path / "out"
    args = ("enqueue", str(src), "--job", "resume", "--output", str(out_dir), "--batch-size", "10")
    first = stack.producer(*args)
    assert "enqueued 6 batches" in first.stdout
    again = stack.producer(*args)
    assert "enqueued 0 batches" in again.stdout and "6 already queued" in again.stdout

    # A partial run: two batches finish, then the broker and the ledger's queue are lost.
    _, url = stack.sim("sim0", *SIM_FLAGS)
    redis_client.delete(*broker.queue_lists(keys.SHARED_QUEUE))
    ledger = Ledger(redis_client)
    for batch in ("b000001", "b000002", "b000003", "b000004", "b000005", "b000006"):
        ledger.batches.unqueue("resume", batch)
    from fleetgen.dispatch import dispatch

    dispatch(celery_app, ledger, "resume", ["b000002", "b000005"], keys.SHARED_QUEUE)
    worker = stack.worker(0, url)
    from fleetgen.poll import wait_until

    wait_until(lambda: len(list((out_dir / "resume/results").glob("*.jsonl"))) == 2
               if (out_dir / "resume/results").exists() else False, 120, what="two batches done")
    worker.stop()
    partial = stack.producer(*args)
    assert "enqueued 4 batches" in partial.stdout and "2 done" in partial.stdout
    stack.worker(0, url)
    wait_job_done(stack, "resume", timeout=120)
    done = stack.producer(*args)
    assert "enqueued 0 batches" in done.stdout and "6 done" in done.stdout
    results, errors = read_results(out_dir, "resume")
    assert sorted(r["id"] for r in results) == sorted(iter_ids(chat_rows(60)))
    assert not errors


def test_a_sigkilled_worker_loses_nothing_and_duplicates_nothing(
    stack: Stack, tmp_path: Path, redis_client: Any
) -> None:
    rows = chat_rows(120)
    src = write_jsonl(tmp_path / "p.jsonl", rows)
    out_dir = tmp_path / "out"
    slow = ("--max-running-requests", "4", "--decode-tps", "80", "--mean-output-tokens", "300",
            "--speed", "10")
    _, url = stack.sim("sim0", *slow)
    victim = stack.worker(0, url)
    stack.producer("enqueue", str(src), "--job", "kill", "--output", str(out_dir), "--batch-size", "20")
    ledger = Ledger(redis_client)
    from fleetgen.poll import wait_until

    # Kill while a batch is half done: some prompts checkpointed, others in flight.
    wait_until(lambda: any(redis_client.hlen(keys.checkpoint("kill", b)) >= 3
                           for b in ledger.batches.running("kill")), 60, what="a batch half done")
    victim.kill()
    stack.worker(0, url, name="gpu0b")
    status = wait_job_done(stack, "kill", timeout=180)
    results, errors = read_results(out_dir, "kill")
    counts = _ids_once(results, errors)
    assert set(counts) == set(iter_ids(rows)) and max(counts.values()) == 1
    assert status.done == 120 and status.failed == 0
    assert any(r["attempt"] == 2 for r in results)

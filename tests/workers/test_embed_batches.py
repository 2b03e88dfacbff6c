"""An embeddings batch is its answers' checkpoint group (workers/batch.py): its answers wait in
the worker for the batch's write and are counted once, by its recording; its failures are
checkpointed as any. Run by a worker's BatchRunner against the simulator and the real Valkey
fixture: a worker that dies before writing loses only the batch's answers, which the next run
asks again, and the job's counters and status count each embedding once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from fleetgen import keys
from fleetgen.endpoints import EMBEDDINGS
from fleetgen.jobview import job_status
from fleetgen.ledger import Ledger
from fleetgen.poll import wait_until
from fleetgen.records import read_record
from fleetgen.settings import Settings
from fleetgen.sink import open_sink
from tests.sim_helpers import running_sim
from tests.stack import make_job
from workers.batch import BatchRunner
from workers.runtime import WorkerRuntime

JOB = "vectors"
BATCH = keys.batch_id(1)
WORKER = "w0@test"
TEXTS = 30
TOO_LONG = "p4"  # longer than the simulator's context: fails, and is checkpointed


class Killed(BaseException):
    """The worker's death as its batch sees it: nothing after it runs, nothing catches it."""


@pytest.fixture
def runner(redis_url: str, redis_client: Any, tmp_path: Path) -> Iterator[BatchRunner]:
    """A worker's BatchRunner on an embedding simulator, with one batch of TEXTS texts of a
    job of one batch, TOO_LONG among them."""
    with running_sim("--is-embedding", "--embedding-dim", "16", "--context-length", "64",
                     "--max-running-requests", "256") as url:
        runtime = WorkerRuntime()
        runtime.configure(Settings(redis_url=redis_url, retry_backoff_s=0.0,
                                   retry_backoff_max_s=0.0), WORKER, [], url)
        try:
            assert runtime.ledger is not None
            manifest = make_job(runtime.ledger, JOB, str(tmp_path / "out"), prompts=TEXTS,
                                batch_size=TEXTS)
            runtime.ledger.jobs.save(dataclasses.replace(manifest, endpoint=EMBEDDINGS))
            rows = [{"id": f"p{i}", "line": i + 1,
                     "body": {"input": "word " * 400 if f"p{i}" == TOO_LONG
                              else f"short text {i}"}} for i in range(TEXTS)]
            open_sink(str(tmp_path / "out")).put(
                keys.sink_input(JOB, BATCH), b"".join(orjson.dumps(r) + b"\n" for r in rows))
            yield runtime.runner()
        finally:
            runtime.shutdown()


def written(tmp_path: Path, kind: str) -> list[dict[str, Any]]:
    path = tmp_path / "out" / JOB / kind / f"{BATCH}.jsonl"
    return [dict(read_record(line)) for line in path.read_bytes().splitlines()]


def floats(redis_client: Any, part: keys.JobPart) -> dict[str, float]:
    return {k.decode(): float(v) for k, v in
            redis_client.hgetall(keys.job_part(JOB, part)).items()}


def killed_at_first_call(monkeypatch: pytest.MonkeyPatch, owner: object, name: str) -> None:
    """`owner.name` raises Killed at its first call, then works as before."""
    real = getattr(owner, name)
    calls = []

    def dies_once(*args: Any, **kwargs: Any) -> Any:
        calls.append(args)
        if len(calls) == 1:
            raise Killed
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, dies_once)


def assert_each_embedding_counted_once(redis_client: Any, ledger: Ledger,
                                       tmp_path: Path) -> None:
    results = written(tmp_path, "results")
    ids = [r["id"] for r in results]
    assert sorted(ids) == sorted({f"p{i}" for i in range(TEXTS)} - {TOO_LONG})
    assert [r["id"] for r in written(tmp_path, "errors")] == [TOO_LONG]
    stats = floats(redis_client, "stats")
    assert (stats["prompts_done"], stats["prompts_failed"]) == (TEXTS - 1, 1)
    assert stats["embeddings"] == TEXTS - 1
    assert stats["input_tokens"] == sum(r["usage"]["prompt_tokens"] for r in results) > 0
    per_worker = floats(redis_client, "workers")
    assert (per_worker[f"{WORKER}|prompts_done"], per_worker[f"{WORKER}|prompts_failed"]) \
        == (TEXTS - 1, 1)
    assert sum(floats(redis_client, "minutes").values()) == TEXTS
    assert sum(floats(redis_client, "worker_minutes").values()) == TEXTS
    status = job_status(ledger, JOB)
    assert (status.state, status.done, status.failed, status.checkpointed) \
        == ("done", TEXTS - 1, 1, 0)


def test_an_embeddings_batch_checkpoints_its_failures_only_and_counts_its_answers_once_written(
    runner: BatchRunner, redis_client: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    checkpointed: list[set[bytes]] = []
    real_finish = runner.ledger.batches.finish_and_settle

    def finish(*args: Any, **kwargs: Any) -> bool:
        checkpointed.append(set(redis_client.hkeys(keys.checkpoint(JOB, BATCH))))
        return real_finish(*args, **kwargs)

    monkeypatch.setattr(runner.ledger.batches, "finish_and_settle", finish)
    outcome = runner.run(JOB, BATCH)
    assert (outcome.status, outcome.done, outcome.failed) == ("done", TEXTS - 1, 1)
    # Just before its recording, the checkpoint held the failure alone.
    assert checkpointed == [{TOO_LONG.encode()}]
    assert_each_embedding_counted_once(redis_client, runner.ledger, tmp_path)
    # The answers still reach the failure breaker's window, as answers.
    wait_until(lambda: redis_client.llen(keys.job_part(JOB, "outcomes")) == TEXTS - 1, 10,
               what="the answers in the breaker's window")
    assert set(redis_client.lrange(keys.job_part(JOB, "outcomes"), 0, -1)) == {b""}


def test_a_worker_killed_before_writing_loses_the_batchs_answers_and_the_next_run_counts_once(
    runner: BatchRunner, redis_client: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    killed_at_first_call(monkeypatch, runner.sink(str(tmp_path / "out")), "put_new")
    with pytest.raises(Killed):
        runner.run(JOB, BATCH)
    # What the dead worker leaves: its failure, checkpointed and counted; no answer anywhere.
    assert set(redis_client.hkeys(keys.checkpoint(JOB, BATCH))) == {TOO_LONG.encode()}
    stats = floats(redis_client, "stats")
    assert (stats.get("prompts_done", 0), stats["prompts_failed"]) == (0, 1)
    status = job_status(runner.ledger, JOB)
    assert (status.done, status.failed, status.checkpointed) == (0, 0, 1)

    outcome = runner.run(JOB, BATCH)
    assert (outcome.status, outcome.done, outcome.failed, outcome.resumed) \
        == ("done", TEXTS - 1, 1, 1)
    assert_each_embedding_counted_once(redis_client, runner.ledger, tmp_path)


def test_a_worker_killed_between_writing_and_recording_is_counted_once_from_the_sink(
    runner: BatchRunner, redis_client: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    killed_at_first_call(monkeypatch, runner.ledger.batches, "finish_and_settle")
    with pytest.raises(Killed):
        runner.run(JOB, BATCH)
    assert floats(redis_client, "stats").get("prompts_done", 0) == 0
    assert runner.run(JOB, BATCH).status == "already-done"
    assert_each_embedding_counted_once(redis_client, runner.ledger, tmp_path)
    # A late copy recording it again adds nothing.
    assert runner.run(JOB, BATCH).status == "already-done"
    assert_each_embedding_counted_once(redis_client, runner.ledger, tmp_path)


def test_answers_a_checkpoint_already_holds_are_not_counted_again_at_the_recording(
    runner: BatchRunner, redis_client: Any, tmp_path: Path,
) -> None:
    # Checkpointed (and counted) one by one before embeddings skipped the checkpoint.
    earlier = {"id": "p0", "line": 1, "reasoning_content": None, "content": "",
               "tool_calls": None, "finish_reason": None, "latency_s": 0.1,
               "usage": {"prompt_tokens": 3, "completion_tokens": 0, "reasoning_tokens": 0},
               "server": "", "worker": WORKER, "attempt": 1, "embedding": ["AAAAAA=="],
               "embedding_format": "float"}
    redis_client.hset(keys.checkpoint(JOB, BATCH), "p0", orjson.dumps(earlier))
    redis_client.hset(keys.job_part(JOB, "stats"), mapping={"prompts_done": 1, "embeddings": 1,
                                                            "input_tokens": 3})
    outcome = runner.run(JOB, BATCH)
    assert (outcome.status, outcome.resumed) == ("done", 1)
    stats = floats(redis_client, "stats")
    assert (stats["prompts_done"], stats["prompts_failed"], stats["embeddings"]) \
        == (TEXTS - 1, 1, TEXTS - 1)

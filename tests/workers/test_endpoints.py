"""A batch of raw completions and one of embeddings, run by a worker's BatchRunner against the
simulator in the matching mode: each prompt's record holds its own answer or vectors, several
embeddings prompts share a request, and a text the server refuses fails its own prompt alone.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from fleetgen import keys
from fleetgen.endpoints import ENDPOINTS
from fleetgen.errors import EndpointError
from fleetgen.records import read_record, vector_floats
from fleetgen.settings import Settings
from fleetgen.sink import open_sink
from launcher.sim import embedding_of
from tests.sim_helpers import running_sim
from tests.stack import make_job
from workers.batch import BatchRunner
from workers.runtime import WorkerRuntime

BATCH = keys.batch_id(1)


@pytest.fixture
def runner_for(redis_url: str, redis_client: Any,
               tmp_path: Path) -> Iterator[Any]:
    """A function that starts a simulator with `flags`, a job of `endpoint` whose batch holds
    `bodies`, and returns the worker's BatchRunner and the simulator's URL."""
    opened: list[Any] = []

    def build(endpoint: str, bodies: list[dict[str, Any]],
              *flags: str) -> tuple[BatchRunner, str]:
        sim = running_sim(*flags)
        url = sim.__enter__()
        opened.append(sim)
        runtime = WorkerRuntime()
        runtime.configure(Settings(redis_url=redis_url, retry_backoff_s=0.0,
                                   retry_backoff_max_s=0.0), "w0@test", [], url)
        opened.append(runtime)
        assert runtime.ledger is not None
        manifest = make_job(runtime.ledger, endpoint, str(tmp_path / "out"),
                            prompts=len(bodies), batch_size=len(bodies))
        runtime.ledger.jobs.save(dataclasses.replace(manifest, endpoint=endpoint))
        rows = [{"id": f"p{i}", "line": i + 1, "body": body} for i, body in enumerate(bodies)]
        open_sink(str(tmp_path / "out")).put(keys.sink_input(endpoint, BATCH),
                                             b"".join(orjson.dumps(r) + b"\n" for r in rows))
        return runtime.runner(), url

    yield build
    for thing in reversed(opened):
        if isinstance(thing, WorkerRuntime):
            thing.shutdown()
        else:
            thing.__exit__(None, None, None)


def records(tmp_path: Path, job: str, kind: str) -> list[dict[str, Any]]:
    path = tmp_path / "out" / job / kind / f"{BATCH}.jsonl"
    if not path.exists():
        return []
    return [dict(read_record(line)) for line in path.read_bytes().splitlines()]


def test_an_embeddings_batch_shares_requests_and_keeps_each_texts_own_vector(
    runner_for: Any, tmp_path: Path,
) -> None:
    texts = [f"document number {i} about topic {i % 7}" for i in range(40)]
    bodies: list[dict[str, Any]] = [{"input": t} for t in texts]
    bodies[5] = {"input": ["first of two", "second of two"]}  # one line of two texts
    bodies[9] = {"input": texts[9], "encoding_format": "float"}
    runner, url = runner_for("embeddings", bodies, "--is-embedding", "--embedding-dim", "64",
                             "--max-running-requests", "256")
    outcome = runner.run("embeddings", BATCH)
    assert (outcome.status, outcome.done, outcome.failed) == ("done", 40, 0)
    got = {r["id"]: r for r in records(tmp_path, "embeddings", "results")}
    for i, body in enumerate(bodies):
        given = body["input"]
        wanted = given if isinstance(given, list) else [given]
        vectors = [vector_floats(v) for v in got[f"p{i}"]["embedding"]]
        assert vectors == [embedding_of(t, dim=64) for t in wanted], i
    assert got["p9"]["embedding_format"] == "float" and got["p0"]["embedding_format"] == "float"
    assert all(r["usage"]["prompt_tokens"] > 0 and r["finish_reason"] is None
               for r in got.values())
    # 41 texts went in fewer requests than prompts: several prompts to a request.
    stats = httpx.get(f"{url}/sim/stats").json()
    assert stats["answered"] < 40, stats


def test_a_text_too_long_fails_its_own_prompt_and_not_the_others_of_its_request(
    runner_for: Any, tmp_path: Path,
) -> None:
    bodies: list[dict[str, Any]] = [{"input": f"short text {i}"} for i in range(12)]
    bodies[4] = {"input": "word " * 400}
    runner, _ = runner_for("embeddings", bodies, "--is-embedding", "--embedding-dim", "16",
                           "--context-length", "64", "--max-running-requests", "256")
    outcome = runner.run("embeddings", BATCH)
    assert (outcome.status, outcome.done, outcome.failed) == ("done", 11, 1)
    failed = records(tmp_path, "embeddings", "errors")
    assert [r["id"] for r in failed] == ["p4"]
    assert failed[0]["error"]["code"] == "context_length_exceeded", failed[0]["error"]


def test_a_raw_completion_batch_records_each_continuation_as_its_content(
    runner_for: Any, tmp_path: Path,
) -> None:
    bodies: list[dict[str, Any]] = [{"prompt": f"Once upon a time {i}", "max_tokens": 8}
                                    for i in range(6)]
    runner, _ = runner_for("completions", bodies)
    outcome = runner.run("completions", BATCH)
    assert (outcome.status, outcome.done, outcome.failed) == ("done", 6, 0), records(
        tmp_path, "completions", "errors")
    got = records(tmp_path, "completions", "results")
    assert len(got) == 6
    assert all(r["content"] and r["finish_reason"] in ("stop", "length")
               and r["usage"]["completion_tokens"] > 0 for r in got)


@pytest.mark.parametrize(("endpoint", "body", "flags", "served"), [
    ("chat", {"messages": [{"role": "user", "content": "hi"}]}, ("--is-embedding",),
     "an embedding model"),
    ("embeddings", {"input": "hi"}, (), "a generation model"),
], ids=["chat-job-on-an-embedding-model", "embeddings-job-on-a-generation-model"])
def test_a_batch_its_server_cannot_serve_goes_back_unleased_to_other_workers(
    runner_for: Any, redis_client: Any, endpoint: str, body: dict[str, Any],
    flags: tuple[str, ...], served: str,
) -> None:
    runner, url = runner_for(endpoint, [body] * 3, *flags)
    runner.backend.discovery.server = None
    runner.loop.run(runner.backend.discovery.refresh())
    with pytest.raises(EndpointError) as refused:
        runner.run(endpoint, BATCH)
    assert str(refused.value) == (
        f"worker w0@test: its server {url} serves {served}; job {endpoint} asks "
        f"{ENDPOINTS[endpoint].path}: its batches go to other workers")
    assert not redis_client.exists(keys.lease(endpoint, BATCH))
    assert httpx.get(f"{url}/sim/stats").json()["answered"] == 0

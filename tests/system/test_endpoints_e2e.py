"""End to end: a job of raw completions and a job of embeddings on one fleet of real worker
processes and simulators, one of the workers killed -9 in the middle of the embeddings: every
prompt of both is exported exactly once, each vector the one its text has."""

from __future__ import annotations

import collections
from pathlib import Path
from typing import Any

import orjson
import pytest

from fleetgen.jobview import job_status
from fleetgen.ledger import Ledger
from fleetgen.records import vector_floats
from launcher.sim import embedding_of
from tests.stack import Stack, wait_job_done, write_jsonl

pytestmark = pytest.mark.e2e

DIM = 32
TEXTS = 20_000
COMPLETIONS = 500


def _text(i: int) -> str:
    return f"passage {i}: the {i % 97}th kind of thing, told {i % 13} ways"


def test_completions_and_embeddings_jobs_are_exported_exactly_once_through_a_worker_kill(
    stack: Stack, tmp_path: Path,
) -> None:
    _, gen_url = stack.sim("gen", "--max-running-requests", "64", "--speed", "50",
                           "--mean-output-tokens", "40")
    _, emb_url = stack.sim("emb", "--is-embedding", "--embedding-dim", str(DIM),
                           "--max-running-requests", "512")
    stack.worker(0, gen_url)
    embedder = stack.worker(1, emb_url)
    texts = write_jsonl(tmp_path / "texts.jsonl",
                        [{"id": f"t{i:05d}", "text": _text(i)} for i in range(TEXTS)])
    prompts = write_jsonl(tmp_path / "prompts.jsonl",
                          [{"custom_id": f"c{i:03d}", "method": "POST", "url": "/v1/completions",
                            "body": {"prompt": f"Once upon a time {i}", "max_tokens": 400}}
                           for i in range(COMPLETIONS)])
    out = str(tmp_path / "out")
    enqueued = stack.producer("enqueue", str(texts), "--job", "vectors", "--endpoint",
                              "embeddings", "--output", out, "--queue", "gpu1")
    assert "20,000 prompts" in enqueued.stdout, enqueued.stdout
    stack.producer("enqueue", str(prompts), "--job", "raw", "--output", out, "--queue", "gpu0")

    # Killed -9 once some of its answers are checkpointed and before the job is done; a new
    # worker under the same name finishes the job.
    ledger = Ledger.from_url(stack.base_env["REDIS_URL"])

    def some_checkpointed() -> bool:
        status = job_status(ledger, "vectors")
        return status.checkpointed + status.done >= TEXTS // 5 or status.state == "done"

    from fleetgen.poll import wait_until

    wait_until(some_checkpointed, 240, what="a fifth of the embeddings answered")
    assert job_status(ledger, "vectors").state != "done", "the job ended before the kill"
    embedder.kill()
    stack.worker(1, emb_url)
    vectors = wait_job_done(stack, "vectors", timeout=300)
    raw = wait_job_done(stack, "raw", timeout=300)
    assert (vectors.done, vectors.failed, raw.done, raw.failed) == (TEXTS, 0, COMPLETIONS, 0)

    exported = tmp_path / "vectors.jsonl"
    stack.producer("export", "vectors", "--output", out, "--to", str(exported))
    rows = [orjson.loads(line) for line in exported.read_bytes().splitlines()]
    seen = collections.Counter(r["id"] for r in rows)
    assert len(seen) == TEXTS and max(seen.values()) == 1
    for row in rows[:: TEXTS // 50]:
        i = int(row["id"][1:])
        assert _vectors(row) == [embedding_of(_text(i), dim=DIM)], row["id"]

    exported = tmp_path / "vectors.openai.jsonl"
    stack.producer("export", "vectors", "--output", out, "--to", str(exported),
                   "--format", "openai")
    lines = [orjson.loads(line) for line in exported.read_bytes().splitlines()]
    assert sorted(line["custom_id"] for line in lines) == sorted(seen)
    for line in lines[:: TEXTS // 50]:
        body = line["response"]["body"]
        i = int(line["custom_id"][1:])
        assert body["object"] == "list" and body["usage"]["prompt_tokens"] > 0
        assert [d["embedding"] for d in body["data"]] == [embedding_of(_text(i), dim=DIM)]

    import pyarrow as pa
    import pyarrow.parquet as pq

    exported = tmp_path / "vectors.parquet"
    stack.producer("export", "vectors", "--output", out, "--to", str(exported),
                   "--format", "parquet")
    table = pq.read_table(exported)
    assert table.schema.field("embedding").type == pa.list_(pa.float32(), DIM)
    ids = table.column("id").to_pylist()
    assert len(ids) == TEXTS and len(set(ids)) == TEXTS
    at = ids.index("t01234")
    assert table.column("embedding")[at].as_py() == embedding_of(_text(1234), dim=DIM)

    for fmt in ("jsonl", "openai"):
        exported = tmp_path / f"raw.{fmt}"
        stack.producer("export", "raw", "--output", out, "--to", str(exported), "--format", fmt)
        rows = [orjson.loads(line) for line in exported.read_bytes().splitlines()]
        named = sorted(r["custom_id"] if fmt == "openai" else r["id"] for r in rows)
        assert named == [f"c{i:03d}" for i in range(COMPLETIONS)]
        texts_of = [r["response"]["body"]["choices"][0]["text"] if fmt == "openai"
                    else r["content"] for r in rows]
        assert all(texts_of)


def _vectors(row: dict[str, Any]) -> list[list[float]]:
    """A row's vectors as floats, whichever form the export gave them in."""
    given = row["embedding"]
    return [vector_floats(v) if isinstance(v, str) else v for v in given]

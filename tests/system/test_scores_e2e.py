"""End to end: a classify job on an SGLang-shaped classifier (plain lines, /v1/classify) and one
on a vLLM-shaped one (OpenAI Batch lines, vLLM's /classify), each on real worker processes and
simulators: every prompt exported exactly once, each text's label the one its logits give."""

from __future__ import annotations

import collections
import math
from pathlib import Path

import orjson
import pytest

from launcher.sim.classify import logits_of
from tests.stack import Stack, wait_job_done, write_jsonl

pytestmark = pytest.mark.e2e

LABELS = ["negative", "positive"]
PROMPTS = 300


def _text(i: int) -> str:
    return f"review {i}: the {i % 31}th thing was {'fine' if i % 3 else 'awful'}"


def _label(text: str) -> str:
    logits = logits_of(text, len(LABELS))
    return LABELS[logits.index(max(logits))]


def test_classify_jobs_on_sglang_and_vllm_are_exported_exactly_once(
    stack: Stack, tmp_path: Path,
) -> None:
    labels = ",".join(LABELS)
    _, sglang_url = stack.sim("sgl", "--is-embedding", "--labels", labels)
    _, vllm_url = stack.sim("vll", "--flavor", "vllm", "--runner", "pooling", "--labels", labels)
    stack.worker(0, sglang_url)
    stack.worker(1, vllm_url)
    plain = write_jsonl(tmp_path / "plain.jsonl",
                        [{"id": f"p{i:03d}", "text": _text(i)} for i in range(PROMPTS)])
    batch = write_jsonl(tmp_path / "batch.jsonl",
                        [{"custom_id": f"b{i:03d}", "method": "POST", "url": "/classify",
                          "body": {"input": [_text(i), _text(i + 1)]}}
                         for i in range(PROMPTS)])
    out = str(tmp_path / "out")
    stack.producer("enqueue", str(plain), "--job", "sgl-classes", "--endpoint", "classify",
                   "--output", out, "--queue", "gpu0")
    stack.producer("enqueue", str(batch), "--job", "vllm-classes", "--output", out,
                   "--queue", "gpu1")
    for job in ("sgl-classes", "vllm-classes"):
        status = wait_job_done(stack, job, timeout=300)
        assert (status.done, status.failed) == (PROMPTS, 0), job

    exported = tmp_path / "sgl.jsonl"
    stack.producer("export", "sgl-classes", "--output", out, "--to", str(exported))
    rows = [orjson.loads(line) for line in exported.read_bytes().splitlines()]
    seen = collections.Counter(r["id"] for r in rows)
    assert len(seen) == PROMPTS and max(seen.values()) == 1
    for row in rows:
        i = int(row["id"][1:])
        assert row["label"] == [_label(_text(i))], row["id"]
        assert math.isclose(sum(row["probs"][0]), 1.0)

    exported = tmp_path / "vllm.openai.jsonl"
    stack.producer("export", "vllm-classes", "--output", out, "--to", str(exported),
                   "--format", "openai")
    lines = [orjson.loads(line) for line in exported.read_bytes().splitlines()]
    assert sorted(line["custom_id"] for line in lines) == [f"b{i:03d}" for i in range(PROMPTS)]
    for line in lines:
        body = line["response"]["body"]
        i = int(line["custom_id"][1:])
        assert body["object"] == "list" and body["usage"]["prompt_tokens"] > 0
        assert [d["label"] for d in body["data"]] == [_label(_text(i)), _label(_text(i + 1))]
        assert [d["num_classes"] for d in body["data"]] == [2, 2]

    import pyarrow.parquet as pq

    exported = tmp_path / "vllm.parquet"
    stack.producer("export", "vllm-classes", "--output", out, "--to", str(exported),
                   "--format", "parquet")
    table = pq.read_table(exported).to_pylist()
    assert len(table) == 2 * PROMPTS
    assert collections.Counter(r["id"] for r in table) == {f"b{i:03d}": 2 for i in range(PROMPTS)}
    first = next(r for r in table if r["id"] == "b007" and r["index"] == 1)
    assert first["label"] == _label(_text(8)) and len(first["probs"]) == 2

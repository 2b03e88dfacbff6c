"""A classify job's records (`records.split_pooled`, `records.classified_record`) as each export
format writes them, and where the worker's requests go on each server kind."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson

from fleetgen.endpoints import BY_PATH, CLASSIFY, ENDPOINTS
from fleetgen.records import Origin, classified_record, error_record, split_pooled
from fleetgen.servers import KINDS, Server
from producer import export

ORIGIN = Origin("http://gpu0:30000", "gpu0@host", 1)
ANSWER: dict[str, Any] = {
    "object": "list",
    "data": [{"index": i, "label": label, "probs": probs, "num_classes": 2}
             for i, (label, probs) in enumerate([("pos", [0.2, 0.8]), ("neg", [0.9, 0.1]),
                                                 ("pos", [0.4, 0.6])])],
    "usage": {"prompt_tokens": 30, "total_tokens": 30},
}


def records() -> list[Any]:
    """Two prompts of one request (one text, then two), and a failed third."""
    split = split_pooled(ANSWER, [1, 2], [10, 20])  # type: ignore[arg-type]
    made = [classified_record(f"p{i}", i, items, tokens, 0.5, ORIGIN)
            for i, (items, tokens) in enumerate(split)]
    return [*made, error_record("p2", 2, "too long", 400, ORIGIN, 1, code="context_length")]


def test_each_prompt_keeps_its_own_texts_labels_and_its_share_of_the_tokens() -> None:
    first, second, _ = records()
    assert (first["label"], first["probs"]) == (["pos"], [[0.2, 0.8]])
    assert (second["label"], second["probs"]) == (["neg", "pos"], [[0.9, 0.1], [0.4, 0.6]])
    assert first["usage"]["prompt_tokens"] + second["usage"]["prompt_tokens"] == 30


def test_the_openai_export_gives_the_body_the_server_answered() -> None:
    line = export.openai_line(records()[1], "clf", CLASSIFY)
    body = line["response"]["body"]
    assert line["custom_id"] == "p1" and body["object"] == "list"
    assert body["data"] == [{"index": 0, "label": "neg", "probs": [0.9, 0.1], "num_classes": 2},
                            {"index": 1, "label": "pos", "probs": [0.4, 0.6], "num_classes": 2}]


def test_the_parquet_export_has_a_row_per_text_and_one_per_failed_line(tmp_path: Path) -> None:
    import pyarrow.parquet as pq

    path = tmp_path / "out.parquet"
    assert export.write(path, "parquet", records(), "clf", endpoint=CLASSIFY) == 4
    rows = pq.read_table(path).to_pylist()
    assert [(r["id"], r["index"], r["label"], r["status"]) for r in rows] == [
        ("p0", 0, "pos", "ok"), ("p1", 0, "neg", "ok"), ("p1", 1, "pos", "ok"),
        ("p2", None, None, "failed")]
    assert rows[2]["probs"] == [0.4, 0.6] and rows[2]["prompt_tokens"] is None


def test_the_jsonl_export_keeps_the_record_and_grouping_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "out.jsonl"
    export.write(path, "jsonl", records(), "clf", endpoint=CLASSIFY)
    assert orjson.loads(path.read_bytes().splitlines()[0])["label"] == ["pos"]
    assert "a classify prompt has one" in str(export.job_problem(CLASSIFY, grouped=True))


def test_vllm_is_sent_classify_requests_at_its_own_route_and_sglang_at_v1() -> None:
    kind = ENDPOINTS[CLASSIFY]
    assert Server(KINDS["vllm"]).path(kind) == "/classify"
    assert Server(KINDS["sglang"]).path(kind) == "/v1/classify"
    assert BY_PATH["/classify"] is BY_PATH["/v1/classify"] is kind

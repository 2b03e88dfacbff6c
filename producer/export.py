"""`python -m producer export JOB --to PATH`: one dataset, every input id exactly once.

Reads the sink alone (inputs, results, errors), so it works even if Redis was lost. Each id's
latest outcome wins: a success beats an earlier failure (after `requeue --failed`); a second
success of the same id (a late duplicate) is dropped and counted.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from workers import keys
from workers.sink import Sink, iter_jsonl

FORMATS = ("jsonl", "openai", "parquet")


@dataclass
class Reconcile:
    input: int = 0
    done: int = 0
    failed: int = 0
    missing: int = 0
    duplicates_dropped: int = 0
    missing_ids: list[str] = field(default_factory=list)

    def line(self) -> str:
        return (f"input {self.input:,}  done {self.done:,}  failed {self.failed:,}  "
                f"missing {self.missing:,}  duplicates dropped {self.duplicates_dropped:,}")


def collect(sink: Sink, job: str) -> tuple[list[str], dict[str, dict[str, Any]], Reconcile]:
    """Input ids in input order, each id's chosen outcome, and the reconcile counts."""
    order: list[str] = []
    seen: set[str] = set()
    for row in iter_jsonl(sink, f"{job}/inputs/"):
        if row["id"] not in seen:
            seen.add(row["id"])
            order.append(row["id"])
    outcome: dict[str, dict[str, Any]] = {}
    report = Reconcile(input=len(order))
    for err in iter_jsonl(sink, keys.sink_errors_prefix(job)):
        outcome[err["custom_id"]] = err
    for res in iter_jsonl(sink, keys.sink_results_prefix(job)):
        previous = outcome.get(res["id"])
        if previous is not None and "custom_id" not in previous:
            report.duplicates_dropped += 1
            continue
        outcome[res["id"]] = res
    for prompt_id in order:
        chosen = outcome.get(prompt_id)
        if chosen is None:
            report.missing += 1
            if len(report.missing_ids) < 20:
                report.missing_ids.append(prompt_id)
        elif "custom_id" in chosen:
            report.failed += 1
        else:
            report.done += 1
    return order, outcome, report


def openai_line(record: dict[str, Any], model: str) -> dict[str, Any]:
    """A result or error in OpenAI Batch output format."""
    if "custom_id" in record:
        return {"id": record["id"], "custom_id": record["custom_id"],
                "response": record["response"], "error": record["error"]}
    message: dict[str, Any] = {"role": "assistant", "content": record["content"],
                               "reasoning_content": record["reasoning_content"]}
    if record.get("tool_calls"):
        message["tool_calls"] = record["tool_calls"]
    usage = record["usage"]
    return {
        "id": f"fg-{record['id']}",
        "custom_id": record["id"],
        "response": {
            "status_code": 200,
            "request_id": f"fg-{record['id']}-{record['attempt']}",
            "body": {
                "object": "chat.completion",
                "model": model,
                "choices": [{"index": 0, "message": message, "finish_reason": record["finish_reason"]}],
                "usage": {**usage, "total_tokens": usage["prompt_tokens"] + usage["completion_tokens"]},
            },
        },
        "error": None,
    }


def write(path: Path, fmt: str, order: list[str], outcome: dict[str, dict[str, Any]], model: str) -> int:
    rows = (outcome[i] for i in order if i in outcome)
    path.parent.mkdir(parents=True, exist_ok=True)
    if fmt == "parquet":
        return _write_parquet(path, rows)
    count = 0
    with path.open("wb") as f:
        for row in rows:
            f.write(orjson.dumps(openai_line(row, model) if fmt == "openai" else row) + b"\n")
            count += 1
    return count


def _write_parquet(path: Path, rows: Iterator[dict[str, Any]]) -> int:
    import pyarrow as pa
    import pyarrow.parquet as pq

    table: dict[str, list[Any]] = {k: [] for k in (
        "id", "status", "reasoning_content", "content", "tool_calls", "finish_reason",
        "prompt_tokens", "completion_tokens", "reasoning_tokens", "error", "worker", "attempt")}
    for r in rows:
        failed = "custom_id" in r
        usage = r.get("usage") or {}
        table["id"].append(r["custom_id"] if failed else r["id"])
        table["status"].append("failed" if failed else "ok")
        table["reasoning_content"].append(None if failed else r["reasoning_content"])
        table["content"].append(None if failed else r["content"])
        table["tool_calls"].append(orjson.dumps(r["tool_calls"]).decode() if r.get("tool_calls") else None)
        table["finish_reason"].append(None if failed else r["finish_reason"])
        for k in ("prompt_tokens", "completion_tokens", "reasoning_tokens"):
            table[k].append(usage.get(k))
        table["error"].append(r["error"]["message"] if failed else None)
        table["worker"].append(r.get("worker"))
        table["attempt"].append(r.get("attempt"))
    pq.write_table(pa.table(table), path)
    return len(table["id"])

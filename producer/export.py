"""`python -m producer export JOB --to PATH`: one dataset, every input id exactly once.

The dataset is the job's one reading (producer/sinkview.py): each id's newest outcome, in
input order, read from the sink alone one batch at a time, so it works even if Redis lost the
job (`--output URI` names the sink then) and its memory does not grow with the job. This module
writes it: as JSONL, OpenAI Batch lines or Parquet, streamed, into a file written beside PATH
and moved into place at the end (`Staged`), so an interrupted export never leaves half a file
under PATH; and it refuses a PATH that must not be written (`target_problem`).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import secrets
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Self

import orjson

from fleetgen.job import InputInfo
from fleetgen.records import is_failure

FORMATS = ("jsonl", "openai", "parquet")


def format_problem(fmt: str) -> str | None:
    """Why `fmt` cannot be written here, or None: checked before the job is read, so a missing
    library costs no reading."""
    if fmt == "parquet" and importlib.util.find_spec("pyarrow") is None:
        return "--format parquet needs pyarrow, which is not installed: pip install 'fleetgen[parquet]'"
    return None


def openai_line(record: dict[str, Any], model: str) -> dict[str, Any]:
    """A result or error in OpenAI Batch output format: `custom_id` is the input id, `id` the
    request's own id (`fg-` and the input id), on every line."""
    if is_failure(record):
        return {"id": f"fg-{record['id']}", "custom_id": record["id"],
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


def write(path: Path, fmt: str, rows: Iterable[dict[str, Any]], model: str) -> int:
    """Write `rows` to `path` in `fmt`, streaming; returns the number of rows."""
    if fmt == "parquet":
        return _write_parquet(path, rows)
    count = 0
    with path.open("wb") as f:
        for row in rows:
            f.write(orjson.dumps(openai_line(row, model) if fmt == "openai" else row) + b"\n")
            count += 1
    return count


PARQUET_COLUMNS = {
    "id": "string", "status": "string", "reasoning_content": "string", "content": "string",
    "tool_calls": "string", "finish_reason": "string", "prompt_tokens": "int64",
    "completion_tokens": "int64", "reasoning_tokens": "int64", "error": "string",
    "worker": "string", "attempt": "int64",
}
# A row group is written when its text reaches this size (or ROW_GROUP_ROWS rows). Peak RSS
# is about 100 MB + 5 x this (columns, their Arrow copy, the encoded chunk): 16 MB gives
# ~175 MB and row groups of a few thousand answers (the export benchmark of tests/perf).
ROW_GROUP_BYTES = 16 << 20
ROW_GROUP_ROWS = 65_536


def _write_parquet(path: Path, rows: Iterable[dict[str, Any]]) -> int:
    import pyarrow as pa
    import pyarrow.parquet as pq

    # A fixed schema: every row group must have the same one, whatever its first rows hold.
    schema = pa.schema([(name, pa.type_for_alias(kind)) for name, kind in PARQUET_COLUMNS.items()])
    columns: dict[str, list[Any]] = {name: [] for name in PARQUET_COLUMNS}
    count = buffered = 0
    with pq.ParquetWriter(path, schema) as writer:
        for r in rows:
            failed = is_failure(r)
            usage = r.get("usage") or {}
            columns["id"].append(r["id"])
            columns["status"].append("failed" if failed else "ok")
            columns["reasoning_content"].append(None if failed else r["reasoning_content"])
            columns["content"].append(None if failed else r["content"])
            columns["tool_calls"].append(
                orjson.dumps(r["tool_calls"]).decode() if r.get("tool_calls") else None)
            columns["finish_reason"].append(None if failed else r["finish_reason"])
            for k in ("prompt_tokens", "completion_tokens", "reasoning_tokens"):
                columns[k].append(usage.get(k))
            columns["error"].append(r["error"]["message"] if failed else None)
            columns["worker"].append(r.get("worker"))
            columns["attempt"].append(r.get("attempt"))
            count += 1
            buffered += len(r.get("content") or "") + len(r.get("reasoning_content") or "")
            if buffered >= ROW_GROUP_BYTES or len(columns["id"]) >= ROW_GROUP_ROWS:
                writer.write_table(pa.table(columns, schema=schema))
                columns = {name: [] for name in PARQUET_COLUMNS}
                buffered = 0
        if columns["id"]:
            writer.write_table(pa.table(columns, schema=schema))
    return count


class Staged:
    """PATH written as a temporary file beside it and moved into place only by `publish`, so
    an interrupted export never leaves half a file under PATH; the temporary is removed on exit.

        with Staged(path, force=False) as staged:
            write(staged.tmp, ...)
            staged.publish()
    """

    def __init__(self, path: Path, *, force: bool) -> None:
        self.path = path
        self.force = force
        self.tmp = path.parent / f".{path.name}.{secrets.token_hex(4)}.part"

    def __enter__(self) -> Self:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # O_EXCL: never someone else's file; mode 0o666 so the umask applies as for any file.
        os.close(os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
        return self

    def publish(self) -> bool:
        """Move the file into place; False if PATH appeared meanwhile and force is off."""
        with self.tmp.open("rb") as f:
            os.fsync(f.fileno())  # the data on disk before its name, or a crash can empty it
        if self.force:
            os.replace(self.tmp, self.path)
            return True
        try:
            os.link(self.tmp, self.path)  # create-if-absent, atomically
        except FileExistsError:
            return False
        except OSError:
            # A file system without hard links: a check, then the rename (a narrow race).
            if self.path.exists():
                return False
            os.replace(self.tmp, self.path)
            return True
        self.tmp.unlink()
        return True

    def __exit__(self, *exc_info: object) -> None:
        self.tmp.unlink(missing_ok=True)


def target_problem(path: Path, source: InputInfo, *, force: bool) -> str | None:
    """Why `--to path` must not be written, or None. The job's own input is refused even with
    --force: the export would replace the prompts it was made from."""
    if path.is_dir():
        return f"--to {path}: is a folder; give a file name"
    if not path.exists():
        return None
    if is_job_input(path, source):
        return (f"--to {path} is the job's input file ({source.path}); export to another file "
                "(--force does not allow this)")
    if not force:
        return f"--to {path} exists; pass --force to replace it, or choose another file"
    return None


def is_job_input(path: Path, source: InputInfo) -> bool:
    """Same file as the manifest's input: same inode, or the same bytes (the manifest's path
    is as given to enqueue, possibly relative to another folder, so the digest decides)."""
    try:
        if os.path.samefile(path, Path(source.path).expanduser()):
            return True
    except OSError:
        pass  # the recorded input is not reachable from here
    if path.stat().st_size != source.bytes:
        return False
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest() == source.sha256

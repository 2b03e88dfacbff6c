"""`python -m producer export JOB --to PATH`: one dataset, every answer exactly once.

The dataset is the job's one reading (producer/sinkview.py): each answer's newest outcome (one
per input id, or one per id and index in a job of several answers per prompt), in input order, read from the sink alone one batch at a time, so it works even if Redis lost the
job (`--output URI` names the sink then) and its memory does not grow with the job. This module
writes it: as JSONL, OpenAI Batch lines or Parquet, streamed, into a file written beside PATH
and moved into place at the end (`Staged`), so an interrupted export never leaves half a file
under PATH; and it refuses a PATH that must not be written (`target_problem`).

A job of several answers per prompt has one line per answer, with its index: `sample` in JSONL
and Parquet, and `custom_id` `{id}/{sample}` in OpenAI Batch lines (which need it unique per
line). `grouped` puts a prompt's answers in one row instead, ordered by index (JSONL and
Parquet): `{"id", "line", "answers": [...]}`, its answers being its records less `id` and
`line`. A prompt's answers are next to each other in the reading, so grouping holds one
prompt's answers at a time.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import secrets
from collections.abc import Iterable, Iterator, Mapping
from itertools import groupby
from pathlib import Path
from typing import Any, Self, TypedDict

import orjson

from fleetgen.job import InputInfo
from fleetgen.records import OutputRecord, is_failure, record_key

FORMATS = ("jsonl", "openai", "parquet")
GROUPED_FORMATS = ("jsonl", "parquet")  # an OpenAI Batch line holds one request's response


def format_problem(fmt: str, *, grouped: bool = False) -> str | None:
    """Why `fmt` (`grouped`: a prompt's answers in one row) cannot be written here, or None:
    checked before the job is read, so a missing library costs no reading."""
    if grouped and fmt not in GROUPED_FORMATS:
        return (f"--group-answers writes {' or '.join(GROUPED_FORMATS)}: an OpenAI Batch line "
                "holds one answer")
    if fmt == "parquet" and importlib.util.find_spec("pyarrow") is None:
        return "--format parquet needs pyarrow, which is not installed: pip install 'fleetgen[parquet]'"
    return None


class GroupedRow(TypedDict):
    """A prompt's answers in one row (`--group-answers`): each its record less `id` and `line`."""

    id: str
    line: int
    answers: list[dict[str, Any]]


def openai_line(record: OutputRecord, model: str) -> dict[str, Any]:
    """A result or error in OpenAI Batch output format: `custom_id` is the answer's key (the
    input id, or `{id}/{sample}` in a job of several answers per prompt), `id` the request's own
    id (`fg-` and that key), on every line."""
    key = record_key(record)
    if is_failure(record):
        return {"id": f"fg-{key}", "custom_id": key,
                "response": record["response"], "error": record["error"]}
    message: dict[str, Any] = {"role": "assistant", "content": record["content"],
                               "reasoning_content": record["reasoning_content"]}
    if record.get("tool_calls"):
        message["tool_calls"] = record["tool_calls"]
    usage = record["usage"]
    body: dict[str, Any] = {
        "object": "chat.completion",
        "model": model,
        "choices": [{"index": 0, "message": message, "finish_reason": record["finish_reason"]}],
        "usage": {**usage, "total_tokens": usage["prompt_tokens"] + usage["completion_tokens"]},
    }
    # A rollout's answer: what it returned, its calls and (--keep-calls) each call, beside
    # the completion its `content` makes.
    body.update({k: record[k] for k in ROLLOUT_FIELDS if k in record})  # type: ignore[literal-required]
    return {
        "id": f"fg-{key}",
        "custom_id": key,
        "response": {
            "status_code": 200,
            "request_id": f"fg-{key}-{record['attempt']}",
            "body": body,
        },
        "error": None,
    }


def write(path: Path, fmt: str, rows: Iterable[OutputRecord], model: str, *,
          sampled: bool = False, grouped: bool = False, rollout: bool = False) -> int:
    """Write `rows` to `path` in `fmt`, streaming; returns the number of lines (rows) written.
    `sampled`: the job has several answers per prompt (Parquet gets a `sample` column);
    `grouped`: one row per prompt, its answers in a list; `rollout`: the job runs a rollout
    (Parquet gets its ROLLOUT_COLUMNS)."""
    if fmt == "parquet":
        return _write_parquet(path, rows, sampled=sampled, grouped=grouped, rollout=rollout)
    # OpenAI Batch lines hold one answer each: never grouped (format_problem).
    lines: Iterable[object] = (grouped_rows(rows) if grouped
                               else (openai_line(r, model) for r in rows) if fmt == "openai"
                               else rows)
    count = 0
    with path.open("wb") as f:
        for line in lines:
            f.write(orjson.dumps(line) + b"\n")
            count += 1
    return count


def grouped_rows(rows: Iterable[OutputRecord]) -> Iterator[GroupedRow]:
    """One row per prompt, `{"id", "line", "answers"}`, from a reading in input order (a
    prompt's answers next to each other, by index)."""
    for prompt_id, answers in groupby(rows, key=lambda r: r["id"]):
        first = next(answers)
        yield {"id": prompt_id, "line": first["line"],
               "answers": [_answer(r) for r in (first, *answers)]}


def _answer(record: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in record.items() if k != "id" and k != "line"}


PARQUET_COLUMNS = {
    "id": "string", "status": "string", "reasoning_content": "string", "content": "string",
    "tool_calls": "string", "finish_reason": "string", "prompt_tokens": "int64",
    "completion_tokens": "int64", "reasoning_tokens": "int64", "error": "string",
    "worker": "string", "attempt": "int64",
}
# A rollout job's answers add what the rollout returned, its calls and (--keep-calls) each
# call; the JSON ones as JSON text.
ROLLOUT_FIELDS = ("result", "calls", "trajectory")
ROLLOUT_COLUMNS = {"result": "string", "calls": "int64", "trajectory": "string"}
# The answer's index, after `id`, in the export of a job of several answers per prompt.
PARQUET_SAMPLE = ("sample", "int64")
# A row group is written when its text reaches this size (or ROW_GROUP_ROWS rows). Peak RSS
# is about 100 MB + 5 x this (columns, their Arrow copy, the encoded chunk): 16 MB gives
# ~175 MB and row groups of a few thousand answers (the export benchmark of tests/perf).
ROW_GROUP_BYTES = 16 << 20
ROW_GROUP_ROWS = 65_536


def _write_parquet(path: Path, rows: Iterable[OutputRecord], *, sampled: bool,
                   grouped: bool, rollout: bool) -> int:
    import pyarrow as pa
    import pyarrow.parquet as pq

    # A fixed schema: every row group must have the same one, whatever its first rows hold.
    columns = {**PARQUET_COLUMNS, **(ROLLOUT_COLUMNS if rollout else {})}
    fields = [(name, pa.type_for_alias(kind)) for name, kind in columns.items()]
    if sampled or grouped:
        fields.insert(1, (PARQUET_SAMPLE[0], pa.type_for_alias(PARQUET_SAMPLE[1])))
    if grouped:
        # One row per prompt: its id, and its answers (every other column) as a list of structs.
        schema = pa.schema([fields[0], ("answers", pa.list_(pa.struct(fields[1:])))])
        items: Iterable[dict[str, Any]] = (
            {"id": prompt_id, "answers": [_parquet_row(r, rollout) for r in answers]}
            for prompt_id, answers in groupby(rows, key=lambda r: r["id"]))
    else:
        schema = pa.schema(fields)
        items = (_parquet_row(r, rollout) for r in rows)
    buffer: list[dict[str, Any]] = []
    count = buffered = 0
    with pq.ParquetWriter(path, schema) as writer:
        for item in items:
            buffer.append(item)
            count += 1
            buffered += _text_size(item)
            if buffered >= ROW_GROUP_BYTES or len(buffer) >= ROW_GROUP_ROWS:
                writer.write_table(pa.Table.from_pylist(buffer, schema=schema))
                buffer = []
                buffered = 0
        if buffer:
            writer.write_table(pa.Table.from_pylist(buffer, schema=schema))
    return count


def _parquet_row(r: OutputRecord, rollout: bool = False) -> dict[str, Any]:
    """One record as a Parquet row (PARQUET_COLUMNS, `sample` where the record has one, and
    ROLLOUT_COLUMNS for a rollout job's)."""
    row: dict[str, Any] = {"id": r["id"], "sample": r.get("sample")}
    if is_failure(r):
        row.update(status="failed", reasoning_content=None, content=None, tool_calls=None,
                   finish_reason=None, prompt_tokens=None, completion_tokens=None,
                   reasoning_tokens=None, error=r["error"]["message"])
    else:
        row.update(status="ok", reasoning_content=r["reasoning_content"], content=r["content"],
                   tool_calls=orjson.dumps(r["tool_calls"]).decode() if r["tool_calls"] else None,
                   finish_reason=r["finish_reason"], **r["usage"], error=None)
    row.update(worker=r["worker"], attempt=r["attempt"])
    if rollout:
        raw: dict[str, Any] = dict(r)
        row.update(calls=raw.get("calls"), **{
            k: orjson.dumps(raw[k]).decode() if k in raw else None
            for k in ("result", "trajectory")})
    return row


def _text_size(item: dict[str, Any]) -> int:
    rows = item.get("answers", (item,))
    return sum(len(r["content"] or "") + len(r["reasoning_content"] or "") for r in rows)


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

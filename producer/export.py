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

Each format follows the job's endpoint (fleetgen/endpoints.py). A completions job's answers are
chat's records, their text in `content`: JSONL and Parquet as chat's, OpenAI Batch bodies a
`text_completion`. An embeddings job's record holds a vector per text of its line: JSONL gives
them in the format the line asked for (`embedding_format`: floats, or base64 of little-endian
float32 as stored), OpenAI Batch lines an embeddings `list` body the same way, and Parquet one row
per text, its vector in a fixed-size list column of float32 (float16 on request), written a row
group at a time (`_write_embeddings_parquet`). A classify job's record holds a label and the
classes' probabilities per text of its line: JSONL gives it as stored, OpenAI Batch lines the
`list` body the server answered (`data` of `{index, label, probs, num_classes}`), and Parquet one
row per text with its `label` and `probs` (`_write_classes_parquet`). An embeddings or classify
job is never grouped: a prompt has one answer, its texts' results already in one record
(`job_problem`).
"""

from __future__ import annotations

import array
import hashlib
import importlib.util
import os
import secrets
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from itertools import groupby
from pathlib import Path
from typing import Any, Self, TypedDict, cast

import orjson

from fleetgen.endpoints import CHAT, CLASSIFY, COMPLETIONS, EMBEDDINGS
from fleetgen.errors import FleetgenError
from fleetgen.job import InputInfo
from fleetgen.records import (
    AnswerRecord,
    OutputRecord,
    is_failure,
    record_key,
    vector_bytes,
    vector_floats,
)

FORMATS = ("jsonl", "openai", "parquet")
GROUPED_FORMATS = ("jsonl", "parquet")  # an OpenAI Batch line holds one request's response
# The type of an embeddings job's vectors in Parquet: as the records keep them (exact), or
# half the size.
EMBEDDING_DTYPES = ("float32", "float16")
# pyarrow casts float32 to float16 from this major version on (Arrow's halffloat casts).
FLOAT16_PYARROW = 16


class ExportError(FleetgenError):
    """The job's outcomes cannot be written in the format asked: an embeddings job's vectors of
    different lengths, which one fixed-size Parquet column cannot hold."""


def format_problem(fmt: str, *, grouped: bool = False,
                   embedding_dtype: str | None = None) -> str | None:
    """Why `fmt` (`grouped`: a prompt's answers in one row; `embedding_dtype`: the type of
    Parquet's vectors) cannot be written here, or None: checked before the job is read, so a
    missing library costs no reading. (The rules of cli.RULES read flags whose default is
    none; `--format` has one, so what it allows is checked here.)"""
    if grouped and fmt not in GROUPED_FORMATS:
        return (f"--group-answers writes {' or '.join(GROUPED_FORMATS)}: an OpenAI Batch line "
                "holds one answer")
    if embedding_dtype is not None and fmt != "parquet":
        return (f"--embedding-dtype sets the type of Parquet's embedding column; --format {fmt} "
                "gives vectors as their lines asked (floats or base64 float32): add --format "
                "parquet")
    if fmt == "parquet" and importlib.util.find_spec("pyarrow") is None:
        return "--format parquet needs pyarrow, which is not installed: pip install 'fleetgen[parquet]'"
    if embedding_dtype == "float16":
        import pyarrow as pa

        if int(pa.__version__.split(".")[0]) < FLOAT16_PYARROW:
            return (f"--embedding-dtype float16 needs pyarrow {FLOAT16_PYARROW} or newer (this is "
                    f"{pa.__version__}): pip install 'pyarrow>={FLOAT16_PYARROW}'")
    return None


def job_problem(endpoint: str, *, grouped: bool = False,
                embedding_dtype: str | None = None) -> str | None:
    """Why a job of `endpoint` cannot be exported as asked, or None: checked once its manifest
    is read, before its outcomes are."""
    if endpoint == EMBEDDINGS and grouped:
        return ("--group-answers groups a prompt's several answers: an embeddings prompt has one, "
                "its vectors in one record (export without it)")
    if endpoint == CLASSIFY and grouped:
        return ("--group-answers groups a prompt's several answers: a classify prompt has one, "
                "its texts' classes in one record (export without it)")
    if embedding_dtype is not None and endpoint != EMBEDDINGS:
        return (f"--embedding-dtype sets the type of an embeddings job's vectors: this is a "
                f"{endpoint} job")
    return None


class GroupedRow(TypedDict):
    """A prompt's answers in one row (`--group-answers`): each its record less `id` and `line`."""

    id: str
    line: int
    answers: list[dict[str, Any]]


def openai_line(record: OutputRecord, model: str, endpoint: str = CHAT) -> dict[str, Any]:
    """A result or error in OpenAI Batch output format: `custom_id` is the answer's key (the
    input id, or `{id}/{sample}` in a job of several answers per prompt), `id` the request's own
    id (`fg-` and that key), on every line; a response's `request_id` (and a completion's body
    `id`) adds the attempt that answered. The body is the one `endpoint` answers with: a
    `chat.completion`, a `text_completion`, an embeddings `list` or a classify `list`."""
    key = record_key(record)
    if is_failure(record):
        return {"id": f"fg-{key}", "custom_id": key,
                "response": record["response"], "error": record["error"]}
    request_id = f"fg-{key}-{record['attempt']}"
    if endpoint == EMBEDDINGS:
        body = _embeddings_body(record, model)
    elif endpoint == CLASSIFY:
        body = _classify_body(record, model, request_id)
    elif endpoint == COMPLETIONS:
        body = _completion_body(record, model, request_id)
    else:
        body = _chat_body(record, model, request_id)
    return {
        "id": f"fg-{key}",
        "custom_id": key,
        "response": {"status_code": 200, "request_id": request_id, "body": body},
        "error": None,
    }


def _chat_body(record: AnswerRecord, model: str, request_id: str) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": record["content"],
                               "reasoning_content": record["reasoning_content"]}
    if record.get("tool_calls"):
        message["tool_calls"] = record["tool_calls"]
    body: dict[str, Any] = {
        "id": request_id,
        "object": "chat.completion",
        "model": model,
        "choices": [{"index": 0, "message": message, "finish_reason": record["finish_reason"]}],
        "usage": _usage(record),
    }
    # A rollout's answer: what it returned, its calls and (--keep-calls) each call, beside
    # the completion its `content` makes.
    body.update({k: record[k] for k in ROLLOUT_FIELDS if k in record})  # type: ignore[literal-required]
    return body


def _completion_body(record: AnswerRecord, model: str, request_id: str) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "text": record["content"],
                              "finish_reason": record["finish_reason"], "logprobs": None}
    if record["reasoning_content"] is not None:
        # A thinking model's text split as a reasoning parser would (records.result_record).
        choice["reasoning_content"] = record["reasoning_content"]
    return {"id": request_id, "object": "text_completion", "model": model, "choices": [choice],
            "usage": _usage(record)}


def _embeddings_body(record: AnswerRecord, model: str) -> dict[str, Any]:
    tokens = record["usage"]["prompt_tokens"]
    return {
        "object": "list",
        "model": model,
        "data": [{"object": "embedding", "index": i, "embedding": vector}
                 for i, vector in enumerate(_vectors(record))],
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }


def _classify_body(record: AnswerRecord, model: str, request_id: str) -> dict[str, Any]:
    tokens = record["usage"]["prompt_tokens"]
    return {
        "id": request_id,
        "object": "list",
        "model": model,
        "data": [{"index": i, "label": label, "probs": probs, "num_classes": len(probs)}
                 for i, (label, probs) in enumerate(
                     zip(record.get("label", []), record.get("probs", []), strict=True))],
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0},
    }


def _usage(record: AnswerRecord) -> dict[str, Any]:
    usage = record["usage"]
    return {**usage, "total_tokens": usage["prompt_tokens"] + usage["completion_tokens"]}


def _vectors(record: AnswerRecord) -> list[list[float]] | list[str]:
    """A record's vectors as its line asked for them: base64 as stored, else floats."""
    stored = record.get("embedding", [])
    if record.get("embedding_format") == "base64":
        return stored
    return [vector_floats(v) for v in stored]


def jsonl_line(record: OutputRecord, endpoint: str = CHAT) -> OutputRecord:
    """A record as a JSONL export line: as stored, but an embedding's vectors in the format its
    line asked for (floats unless it asked for base64)."""
    if endpoint != EMBEDDINGS or is_failure(record) or "embedding" not in record:
        return record
    return cast(AnswerRecord, {**record, "embedding": _vectors(record)})


def write(path: Path, fmt: str, rows: Iterable[OutputRecord], model: str, *,
          sampled: bool = False, grouped: bool = False, rollout: bool = False,
          endpoint: str = CHAT, embedding_dtype: str | None = None) -> int:
    """Write `rows` to `path` in `fmt`, streaming; returns the number of lines (rows) written.
    `sampled`: the job has several answers per prompt (Parquet gets a `sample` column);
    `grouped`: one row per prompt, its answers in a list; `rollout`: the job runs a rollout
    (Parquet gets its ROLLOUT_COLUMNS); `endpoint`: the job's (an embeddings job's Parquet has
    a row per vector, of `embedding_dtype`, float32 by default)."""
    if fmt == "parquet" and endpoint == EMBEDDINGS:
        return _write_embeddings_parquet(path, rows, embedding_dtype or "float32")
    if fmt == "parquet" and endpoint == CLASSIFY:
        return _write_classes_parquet(path, rows)
    if fmt == "parquet":
        return _write_parquet(path, rows, sampled=sampled, grouped=grouped, rollout=rollout)
    # OpenAI Batch lines hold one answer each: never grouped (format_problem).
    lines: Iterable[object] = (grouped_rows(rows) if grouped
                               else (openai_line(r, model, endpoint) for r in rows)
                               if fmt == "openai"
                               else (jsonl_line(r, endpoint) for r in rows))
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
    return _write_row_groups(path, schema, items, _text_size)


def _write_row_groups(path: Path, schema: Any, items: Iterable[dict[str, Any]],
                      size: Callable[[dict[str, Any]], int] = lambda item: 0) -> int:
    """Stream `items` into a Parquet file of `schema`, a row group written each ROW_GROUP_ROWS
    rows or ROW_GROUP_BYTES of `size`, whichever comes first; the rows written."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    buffer: list[dict[str, Any]] = []
    count = buffered = 0
    with pq.ParquetWriter(path, schema) as writer:
        for item in items:
            buffer.append(item)
            count += 1
            buffered += size(item)
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


# An embeddings job's Parquet: one row per vector, `embedding` (after `status`) a fixed-size
# list of the job's dimension. `index` is the vector's place in its line's `input` (0 for a
# line of one text). The line's prompt tokens are on the row of its first vector, null on the
# others, so the column sums to the job's. A failed line is one row, its `index`, `embedding`
# and `prompt_tokens` null.
EMBEDDING_COLUMNS = {"id": "string", "index": "int64", "status": "string",
                     "prompt_tokens": "int64", "error": "string", "worker": "string",
                     "attempt": "int64"}


def _write_embeddings_parquet(path: Path, rows: Iterable[OutputRecord], dtype: str) -> int:
    """One row per vector, a row group written each time ROW_GROUP_BYTES of vectors (or
    ROW_GROUP_ROWS rows) are gathered: a row group's vectors are all it holds.

    The column's size is the first vector's; a vector of another length (a line that asked
    for other `dimensions`) ends the export with an ExportError, as one fixed-size column
    cannot hold it. Failed lines before the first vector wait for it (their rows are small)."""
    import pyarrow.parquet as pq

    group = _VectorGroup()
    writer: pq.ParquetWriter | None = None
    count = 0
    try:
        for record in rows:
            count += group.add(record)
            if group.dimension is not None and group.full():
                writer = writer or pq.ParquetWriter(path, group.schema(dtype))
                writer.write_table(group.table(dtype))
                group.clear()
        if len(group) or writer is None:
            writer = writer or pq.ParquetWriter(path, group.schema(dtype))
            writer.write_table(group.table(dtype))
    finally:
        if writer is not None:
            writer.close()
    return count


# A classify job's Parquet: one row per text, its `label` and `probs` (after `status`). As an
# embeddings job's: `index` the text's place in its line's `input`, the line's prompt tokens on
# its first row, and a failed line one row with `index`, `label`, `probs` and `prompt_tokens`
# null.
CLASS_COLUMNS = {"id": "string", "index": "int64", "status": "string", "label": "string",
                 "prompt_tokens": "int64", "error": "string", "worker": "string",
                 "attempt": "int64"}


def _class_rows(record: OutputRecord) -> Iterator[dict[str, Any]]:
    base = {"id": record["id"], "worker": record["worker"], "attempt": record["attempt"]}
    if is_failure(record):
        yield {**base, "index": None, "status": "failed", "label": None, "probs": None,
               "prompt_tokens": None, "error": record["error"]["message"]}
        return
    for index, (label, probs) in enumerate(
            zip(record.get("label", []), record.get("probs", []), strict=True)):
        yield {**base, "index": index, "status": "ok", "label": label, "probs": probs,
               "prompt_tokens": record["usage"]["prompt_tokens"] if index == 0 else None,
               "error": None}


def _write_classes_parquet(path: Path, rows: Iterable[OutputRecord]) -> int:
    """One row per text, a row group written each ROW_GROUP_ROWS rows."""
    import pyarrow as pa

    fields = [(name, pa.type_for_alias(kind)) for name, kind in CLASS_COLUMNS.items()]
    fields.insert(4, ("probs", pa.list_(pa.float64())))
    return _write_row_groups(path, pa.schema(fields),
                             (row for record in rows for row in _class_rows(record)))


class _VectorGroup:
    """The rows of an embeddings Parquet row group being gathered: EMBEDDING_COLUMNS as lists,
    and each row's vector as the bytes its record holds (None for a failed line's row)."""

    def __init__(self) -> None:
        self.dimension: int | None = None  # the first vector's, then every vector's
        self.clear()

    def clear(self) -> None:
        self.columns: dict[str, list[Any]] = {name: [] for name in EMBEDDING_COLUMNS}
        self.vectors: list[bytes | None] = []
        self.size = 0

    def __len__(self) -> int:
        return len(self.vectors)

    def full(self) -> bool:
        return self.size >= ROW_GROUP_BYTES or len(self) >= ROW_GROUP_ROWS

    def add(self, record: OutputRecord) -> int:
        """The record's rows (one per vector, one for a failure); returns their number."""
        if is_failure(record):
            self._row(record, None, None, "failed", None, record["error"]["message"])
            return 1
        vectors = record.get("embedding", [])
        for index, b64 in enumerate(vectors):
            raw = vector_bytes(b64)
            dimension = len(raw) // 4
            if self.dimension is None:
                self.dimension = dimension
            elif dimension != self.dimension:
                raise ExportError(
                    f"id {record['id']} (line {record['line']}): a vector of {dimension} "
                    f"dimensions in a job whose vectors have {self.dimension}; Parquet's "
                    "embedding column is of one size: export as --format jsonl (or openai)")
            tokens = record["usage"]["prompt_tokens"] if index == 0 else None
            self._row(record, index, raw, "ok", tokens, None)
            self.size += len(raw)
        return len(vectors)

    def _row(self, record: OutputRecord, index: int | None, vector: bytes | None, status: str,
             tokens: int | None, error: str | None) -> None:
        values = {"id": record["id"], "index": index, "status": status, "prompt_tokens": tokens,
                  "error": error, "worker": record["worker"], "attempt": record["attempt"]}
        for name, value in values.items():
            self.columns[name].append(value)
        self.vectors.append(vector)

    def schema(self, dtype: str) -> Any:
        import pyarrow as pa

        fields = [(name, pa.type_for_alias(kind)) for name, kind in EMBEDDING_COLUMNS.items()]
        fields.insert(3, ("embedding", pa.list_(pa.type_for_alias(dtype), self.dimension or 0)))
        return pa.schema(fields)

    def table(self, dtype: str) -> Any:
        """The gathered rows as an Arrow table: the vectors' bytes joined into one buffer of
        float32 values (cast to `dtype`), cut into fixed-size lists."""
        import pyarrow as pa

        size = self.dimension or 0
        blank = bytes(4 * size)
        data = b"".join(blank if v is None else v for v in self.vectors)
        if sys.byteorder == "big":  # Arrow's buffers are the host's order; records' little
            swapped = array.array("f", data)
            swapped.byteswap()
            data = swapped.tobytes()
        values = pa.Array.from_buffers(pa.float32(), len(self) * size, [None, pa.py_buffer(data)])
        values = values.cast(pa.type_for_alias(dtype))
        valid = (None if None not in self.vectors
                 else pa.array([v is not None for v in self.vectors]).buffers()[1])
        schema = self.schema(dtype)
        embedding = pa.Array.from_buffers(schema.field("embedding").type, len(self), [valid],
                                          children=[values])
        arrays = {name: pa.array(self.columns[name], pa.type_for_alias(kind))
                  for name, kind in EMBEDDING_COLUMNS.items()}
        arrays["embedding"] = embedding
        return pa.Table.from_arrays([arrays[name] for name in schema.names], schema=schema)


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

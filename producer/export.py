"""`python -m producer export JOB --to PATH`: one dataset, every input id exactly once.

Reads the sink alone (inputs, results, errors), so it works even if Redis was lost, and holds
one batch's objects at a time, so its memory does not grow with the job. Batches are contiguous
slices of the input (b000001, b000002, ...): walking them in order writes the dataset in input
order. Prompts re-run by `requeue --failed` live in extra batches `rNN-NNNNNN` (NN the round);
their outcomes are gathered first into a disk-backed index (a temporary SQLite file) and looked
up batch by batch. Each id's latest outcome wins: a success is final, among failures the latest
round wins, and a second success of the same id (a late duplicate) is dropped and counted. A
requeue batch that has not run yet makes its prompts missing again: their old failure is being
redone, so it is no longer their outcome.

Counts are reconciled with the manifest, not with what the sink happens to hold: `total` is the
prompts enqueue counted, so prompts whose batch input never reached the sink (an interrupted
enqueue) are missing, never silently absent. The file is written beside PATH and moved into
place at the end (`Staged`), so an interrupted export never leaves half a file under PATH.
"""

from __future__ import annotations

import hashlib
import os
import re
import secrets
import sqlite3
from collections import Counter, deque
from collections.abc import Generator, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

import orjson

from workers import keys
from workers.job import InputInfo, JobManifest
from workers.records import is_failure
from workers.sink import Sink, batch_records

FORMATS = ("jsonl", "openai", "parquet")
# `requeue --failed` names its batches r{round:02d}-{n:06d} (producer/control.py).
REQUEUE_BATCH = re.compile(r"^r(\d+)-(\d+)$")
MISSING_EXAMPLES = 20


@dataclass
class Layout:
    """The batch objects the sink holds, by batch name, listed once before reading any.

    Names only (tens of bytes per batch of hundreds of prompts). A batch counts as done when
    its result object was listed here, so a batch finishing during the export is either wholly
    in it or wholly missing (its errors object is written before its results, workers/batch.py).
    """

    inputs: int = 0  # base batch inputs (b000001 ...)
    done: set[str] = field(default_factory=set)  # batches with a result object
    requeue: list[str] = field(default_factory=list)  # requeue batches with an input, in order

    def finished(self, manifest: JobManifest) -> bool:
        """Whether every prompt can have its final outcome (the export cannot be short)."""
        base_done = sum(1 for b in self.done if not REQUEUE_BATCH.match(b))
        return (manifest.complete and self.inputs >= manifest.batches
                and base_done >= manifest.batches and all(b in self.done for b in self.requeue))


def survey(sink: Sink, job: str) -> Layout:
    layout = Layout()
    layout.done.update(_batch_names(sink, keys.sink_results_prefix(job)))
    requeue: list[tuple[int, int, str]] = []
    for name in _batch_names(sink, f"{job}/inputs/"):
        match = REQUEUE_BATCH.match(name)
        if match:
            requeue.append((int(match[1]), int(match[2]), name))
        else:
            layout.inputs += 1
    # By number: `r100-` must come after `r99-`, which a sort by name would not give.
    layout.requeue = [name for _, _, name in sorted(requeue)]
    return layout


def _batch_names(sink: Sink, prefix: str) -> Iterator[str]:
    for key in sink.list_keys(prefix):
        name = key[len(prefix):]
        if name.endswith(".jsonl") and "/" not in name:
            yield name[: -len(".jsonl")]


@dataclass
class Reconcile:
    """What the export found, against the manifest's count of prompts."""

    job: str
    total: int  # the manifest's prompts
    batches: int  # the manifest's batches
    complete: bool  # the manifest says enqueue stored every batch input
    input_batches: int = 0  # batch inputs found in the sink
    inputs: int = 0  # prompt ids found in them
    done: int = 0
    failed: int = 0
    failed_by_code: Counter[str] = field(default_factory=Counter)
    duplicates_dropped: int = 0
    missing_ids: list[str] = field(default_factory=list)  # the first few, in input order

    @classmethod
    def of(cls, manifest: JobManifest, layout: Layout) -> Reconcile:
        return cls(job=manifest.name, total=manifest.prompts, batches=manifest.batches,
                   complete=manifest.complete, input_batches=layout.inputs)

    @property
    def missing(self) -> int:
        return self.total - self.done - self.failed

    def line(self) -> str:
        text = (f"total {self.total:,}  input {self.inputs:,}  done {self.done:,}  "
                f"failed {self.failed:,}  missing {self.missing:,}  "
                f"duplicates dropped {self.duplicates_dropped:,}")
        if self.failed_by_code:
            codes = ", ".join(f"{code} {n:,}" for code, n in sorted(self.failed_by_code.items()))
            text += f"  (failed by code: {codes})"
        return text

    def as_dict(self) -> dict[str, Any]:
        return {
            "job": self.job, "total": self.total, "inputs": self.inputs, "done": self.done,
            "failed": self.failed, "failed_by_code": dict(sorted(self.failed_by_code.items())),
            "missing": self.missing, "duplicates_dropped": self.duplicates_dropped,
            "complete": self.complete,
            "batch_inputs": {"stored": self.input_batches, "total": self.batches},
            "missing_ids": self.missing_ids,
        }

    def problem(self) -> tuple[str, str] | None:
        """Why this is not the whole dataset, and what to do about it; None when it is."""
        stored = f"{self.input_batches:,} of {self.batches:,} batch inputs stored"
        if not self.complete:
            return (f"enqueue of job {self.job} did not finish: {stored}",
                    "re-run the same enqueue command")
        if self.input_batches < self.batches:
            return (f"job {self.job} has only {stored} (an interrupted enqueue, or inputs "
                    "deleted)", "re-run the same enqueue command")
        if self.missing > 0:
            examples = ", ".join(self.missing_ids[:5])
            return (f"job {self.job} is not finished: {self.missing:,} of {self.total:,} prompts "
                    f"have no outcome yet (e.g. {examples})",
                    f"wait for it (python -m producer status {self.job})")
        if self.missing < 0:
            return (f"job {self.job} has {-self.missing:,} more outcomes than its manifest's "
                    f"{self.total:,} prompts: the sink does not match the manifest",
                    f"look at {self.job}/inputs/ in the output before trusting any export")
        return None


# The requeue index's states.
SUCCESS, FAILURE, PENDING = 0, 1, 2
# Ids per lookup: under SQLite's smallest limit on bound parameters (999).
LOOKUP_CHUNK = 500


class RequeueIndex:
    """Each requeued id's latest outcome, in a temporary SQLite file that SQLite deletes on
    close; its page cache (2 MB by default) is all it keeps in memory."""

    def __init__(self) -> None:
        # "": a private on-disk temporary database (https://sqlite.org/inmemorydb.html).
        self.db = sqlite3.connect("")
        self.db.execute("PRAGMA journal_mode=OFF")
        self.db.execute("PRAGMA synchronous=OFF")
        self.db.execute("CREATE TABLE outcome (id TEXT PRIMARY KEY, state INT, record BLOB)")
        self.empty = True

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.db.close()

    def put(self, prompt_id: str, state: int, record: bytes | None) -> bool:
        """Record a newer outcome unless the id already succeeded; False if it had (for a
        success, that makes this one a duplicate)."""
        changed = self.db.execute(
            "INSERT INTO outcome VALUES (?, ?, ?) ON CONFLICT (id) DO UPDATE SET "
            "state = excluded.state, record = excluded.record WHERE outcome.state != 0",
            (prompt_id, state, record)).rowcount
        self.empty = False
        return changed > 0

    def lookup(self, ids: list[str]) -> dict[str, tuple[int, bytes | None]]:
        found: dict[str, tuple[int, bytes | None]] = {}
        if self.empty:
            return found
        for start in range(0, len(ids), LOOKUP_CHUNK):
            chunk = ids[start:start + LOOKUP_CHUNK]
            rows = self.db.execute(
                f"SELECT id, state, record FROM outcome WHERE id IN ({','.join('?' * len(chunk))})",
                chunk)
            found.update((row[0], (row[1], row[2])) for row in rows)
        return found


def outcomes(sink: Sink, manifest: JobManifest, layout: Layout,
             report: Reconcile) -> Generator[dict[str, Any], None, None]:
    """Each input id's chosen outcome (a result or an error record), in input order, counted
    into `report` as they are yielded. Close the iterator (contextlib.closing) when done."""
    job = manifest.name
    with RequeueIndex() as index:
        for batch in layout.requeue:
            _index_requeue_batch(sink, job, batch, layout, index, report)
        index.db.commit()
        for number in range(1, manifest.batches + 1):
            batch = keys.batch_id(number)
            raw = sink.get(keys.sink_input(job, batch))
            if raw is None:
                continue  # never stored: its prompts are missing against manifest.prompts
            ids = [orjson.loads(line)["id"] for line in raw.splitlines() if line]
            del raw
            report.inputs += len(ids)
            results: dict[str, dict[str, Any]] = {}
            errors: dict[str, dict[str, Any]] = {}
            if batch in layout.done:
                for record in batch_records(sink, job, batch):
                    if is_failure(record):
                        errors[record["custom_id"]] = record
                    else:
                        results[record["id"]] = record
            requeued = index.lookup(ids)
            for prompt_id in ids:
                chosen = _choose(results.get(prompt_id), requeued.get(prompt_id),
                                 errors.get(prompt_id), report)
                if chosen is None:
                    if len(report.missing_ids) < MISSING_EXAMPLES:
                        report.missing_ids.append(prompt_id)
                    continue
                if is_failure(chosen):
                    report.failed += 1
                    report.failed_by_code[chosen["error"]["code"]] += 1
                else:
                    report.done += 1
                yield chosen


def _index_requeue_batch(sink: Sink, job: str, batch: str, layout: Layout, index: RequeueIndex,
                         report: Reconcile) -> None:
    if batch not in layout.done:
        # Queued or running: its prompts' earlier failure is no longer their outcome.
        raw = sink.get(keys.sink_input(job, batch)) or b""
        for line in raw.splitlines():
            if line:
                index.put(orjson.loads(line)["id"], PENDING, None)
        return
    # Errors come before results: a prompt in both (a retry after a crash between the two
    # writes) succeeded.
    for record in batch_records(sink, job, batch):
        if is_failure(record):
            index.put(record["custom_id"], FAILURE, orjson.dumps(record))
        elif not index.put(record["id"], SUCCESS, orjson.dumps(record)):
            report.duplicates_dropped += 1


def _choose(result: dict[str, Any] | None, requeued: tuple[int, bytes | None] | None,
            error: dict[str, Any] | None, report: Reconcile) -> dict[str, Any] | None:
    """One id's outcome from its batch's result, its requeue index entry and its batch's error."""
    if result is not None:
        if requeued is not None and requeued[0] == SUCCESS:
            report.duplicates_dropped += 1
        return result
    if requeued is not None:
        state, record = requeued
        return None if state == PENDING or record is None else orjson.loads(record)
    return error


def drain(rows: Iterable[dict[str, Any]]) -> None:
    """Run `rows` through without writing: the reconcile of an export that will be refused."""
    deque(rows, maxlen=0)


def openai_line(record: dict[str, Any], model: str) -> dict[str, Any]:
    """A result or error in OpenAI Batch output format."""
    if is_failure(record):
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
# ~175 MB and row groups of a few thousand answers (tests/perf figure 7).
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
            columns["id"].append(r["custom_id"] if failed else r["id"])
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

"""One reading of a job from its sink: each answer's newest outcome, and the counts.

An answer is what a batch input's line asks for: a prompt's one answer, or one of its several
(`sampling.n`), named by its key (`records.answer_key`: the id, or `id/index`). Below, "id"
means that key: every answer is counted and exported exactly once.

Every command that shows or acts on what a job's prompts came to reads it here: `export` (the
dataset and its reconcile), `requeue --failed` (which prompts failed), `rebuild` and a re-run
`enqueue` after Redis lost the job (the ledger's counters, which `status` and `report` show).
So they cannot disagree.

The sink alone decides (inputs, results, errors; the manifest for the total), and the reading
holds one batch's objects at a time, so its memory does not grow with the job. Batches are
contiguous slices of the input (b000001, b000002, ...): walking them in order gives every id in
input order. Prompts re-run by `requeue --failed` live in extra batches (`keys.requeue_batch_id`,
ordered by `keys.batch_order`: round 100 comes after round 99); their outcomes are gathered
first into a disk-backed index (a temporary SQLite file) and looked up batch by batch.

Each id's newest outcome wins: a success is final, among failures the latest round wins, and a
second success of the same id (a late duplicate) is dropped and counted. A requeue batch that
has not been written yet makes its prompts missing again: their old failure is being redone,
so it is no longer their outcome (and `requeue` took it out of the ledger's failed counters).

Counts are reconciled with the manifest, not with what the sink happens to hold: `total` is the
prompts enqueue counted, so prompts whose batch input never reached the sink (an interrupted
enqueue) are missing, never silently absent.

    layout = survey(sink, job)
    found = Reconcile.of(manifest, layout)
    with closing(outcomes(sink, manifest, layout, found)) as rows:
        for record in rows: ...   # found.done, found.failed, found.failed_by_code as they go
"""

from __future__ import annotations

import sqlite3
from collections import Counter, deque
from collections.abc import Callable, Generator, Iterable, Iterator
from contextlib import closing
from dataclasses import dataclass, field
from typing import Any, Self, get_args

import orjson

from fleetgen import keys
from fleetgen.job import JobManifest, ShownState, read_input_line
from fleetgen.ledger import STATE_CANCELLED, STATE_PAUSED
from fleetgen.progress import progress_key
from fleetgen.records import OutputRecord, answer_key, is_failure, read_record, record_key
from fleetgen.sink import Sink, batch_records

MISSING_EXAMPLES = 20


def stored_manifest(sink: Sink, job: str) -> JobManifest | None:
    """The manifest enqueue stored beside the job's objects, or None if there is none."""
    raw = sink.get(keys.sink_manifest(job))
    return JobManifest.from_json(raw) if raw else None


def stored_state(sink: Sink, job: str) -> tuple[ShownState, str] | None:
    """The job's state and its reason as its progress.json last recorded them (`done`,
    `running`, `paused`, `cancelled`, ...), or None without one. The workers write it within a
    minute of a change, and `pause`, `cancel` and `resume` at once (producer/control.py)."""
    raw = sink.get(progress_key(job))
    if not raw:
        return None
    try:
        status = orjson.loads(raw)
        state, reason = status["state"], str(status.get("reason") or "")
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return None  # a file someone else wrote there: no state recorded
    return (state, reason) if state in get_args(ShownState) else None


@dataclass
class Layout:
    """The batch objects the sink holds, by batch name, listed once before reading any.

    Names only (tens of bytes per batch of hundreds of prompts). A batch counts as done when
    its result object was listed here, so a batch finishing during the reading is either wholly
    in it or wholly missing (its errors object is written before its results, workers/batch.py).
    """

    inputs: int = 0  # base batch inputs (b000001 ...)
    done: set[str] = field(default_factory=set)  # batches with a result object
    requeue: list[str] = field(default_factory=list)  # requeue batches with an input, in order

    def finished(self, manifest: JobManifest) -> bool:
        """Whether every prompt can have its final outcome (the export cannot be short)."""
        base_done = sum(1 for b in self.done if keys.requeue_round(b) is None)
        return (manifest.complete and self.inputs >= manifest.batches
                and base_done >= manifest.batches and all(b in self.done for b in self.requeue))

    @property
    def last_round(self) -> int:
        """The number of the job's last requeue round the sink holds (0: none)."""
        return max((keys.requeue_round(b) or 0 for b in self.requeue), default=0)


def survey(sink: Sink, job: str) -> Layout:
    layout = Layout()
    layout.done.update(_batch_names(sink, keys.sink_results_prefix(job)))
    requeue: list[str] = []
    for name in _batch_names(sink, f"{job}/inputs/"):
        if keys.requeue_round(name) is None:
            layout.inputs += 1
        else:
            requeue.append(name)
    layout.requeue = sorted(requeue, key=keys.batch_order)
    return layout


def _batch_names(sink: Sink, prefix: str) -> Iterator[str]:
    for key in sink.list_keys(prefix):
        name = key[len(prefix):]
        if name.endswith(".jsonl") and keys.is_batch(name[: -len(".jsonl")]):
            yield name[: -len(".jsonl")]


@dataclass
class Reconcile:
    """What the reading found, against the manifest's count of answers."""

    job: str
    total: int  # the manifest's answers (its prompts, in a job of one answer per prompt)
    batches: int  # the manifest's batches
    complete: bool  # the manifest says enqueue stored every batch input
    input_batches: int = 0  # batch inputs found in the sink
    inputs: int = 0  # answer keys found in them
    done: int = 0
    failed: int = 0
    failed_by_code: Counter[str] = field(default_factory=Counter)
    duplicates_dropped: int = 0
    missing_ids: list[str] = field(default_factory=list)  # the first few, in input order
    unit: str = "prompts"  # what `total` counts, in messages: "answers" in a job of several


    @classmethod
    def of(cls, manifest: JobManifest, layout: Layout) -> Reconcile:
        return cls(job=manifest.name, total=manifest.answers, batches=manifest.batches,
                   complete=manifest.complete, input_batches=layout.inputs,
                   unit="answers" if manifest.sampled else "prompts")

    @property
    def missing(self) -> int:
        return self.total - self.done - self.failed

    def count(self, record: OutputRecord) -> None:
        """Count one id's chosen outcome."""
        if is_failure(record):
            self.failed += 1
            self.failed_by_code[record["error"]["code"]] += 1
        else:
            self.done += 1

    def written(self) -> dict[str, float]:
        """These counts as the ledger's written counters (what `status` shows as done, failed
        and failures by code; the fields of `records.written_counts`)."""
        return {"prompts_done": self.done, "prompts_failed": self.failed,
                **{f"error_{code}": n for code, n in self.failed_by_code.items()}}

    def line(self) -> str:
        text = (f"total {self.total:,}  input {self.inputs:,}  done {self.done:,}  "
                f"failed {self.failed:,}  missing {self.missing:,}  "
                f"duplicates dropped {self.duplicates_dropped:,}")
        if self.failed_by_code:
            text += f"  (failed by code: {self.codes()})"
        return text

    def codes(self) -> str:
        return ", ".join(f"{code} {n:,}" for code, n in sorted(self.failed_by_code.items()))

    def as_dict(self) -> dict[str, Any]:
        return {
            "job": self.job, "total": self.total, "inputs": self.inputs, "done": self.done,
            "failed": self.failed, "failed_by_code": dict(sorted(self.failed_by_code.items())),
            "missing": self.missing, "duplicates_dropped": self.duplicates_dropped,
            "complete": self.complete,
            "batch_inputs": {"stored": self.input_batches, "total": self.batches},
            "missing_ids": self.missing_ids,
        }

    def problem(self, state: str | None = None) -> tuple[str, str] | None:
        """Why this is not the whole dataset, and what to do about it; None when it is. `state`
        is the job's state in the ledger (None: unknown): a paused or cancelled job is not
        waited for but resumed."""
        stored = f"{self.input_batches:,} of {self.batches:,} batch inputs stored"
        if not self.complete:
            return (f"enqueue of job {self.job} did not finish: {stored}",
                    "re-run the same enqueue command")
        if self.input_batches < self.batches:
            return (f"job {self.job} has only {stored} (an interrupted enqueue, or inputs "
                    "deleted)", "re-run the same enqueue command")
        if self.missing > 0:
            examples = ", ".join(self.missing_ids[:5])
            outcomes = (f"{self.missing:,} of {self.total:,} {self.unit} have no outcome yet (e.g. "
                        f"{examples})")
            if state in (STATE_PAUSED, STATE_CANCELLED):
                return (f"job {self.job} is {state}: {outcomes}",
                        f"resume it to finish them (python -m producer resume {self.job})")
            return (f"job {self.job} is not finished: {outcomes}",
                    f"wait for it (python -m producer status {self.job})")
        if self.missing < 0:
            return (f"job {self.job} has {-self.missing:,} more outcomes than its manifest's "
                    f"{self.total:,} {self.unit}: the sink does not match the manifest",
                    f"look at {self.job}/inputs/ in the output before trusting any export")
        return None


def read(sink: Sink, manifest: JobManifest,
         each: Callable[[OutputRecord], None] | None = None) -> tuple[Layout, Reconcile]:
    """Read the whole job once: its layout and counts; `each` sees every chosen outcome, in
    input order."""
    layout = survey(sink, manifest.name)
    found = Reconcile.of(manifest, layout)
    with closing(outcomes(sink, manifest, layout, found)) as rows:
        for record in rows:
            if each is not None:
                each(record)
    return layout, found


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
             report: Reconcile) -> Generator[OutputRecord, None, None]:
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
                continue  # never stored: its answers are missing against manifest.answers
            ids = [_input_key(line) for line in raw.splitlines() if line]
            del raw
            report.inputs += len(ids)
            results: dict[str, OutputRecord] = {}
            errors: dict[str, OutputRecord] = {}
            if batch in layout.done:
                for record in batch_records(sink, job, batch):
                    (errors if is_failure(record) else results)[record_key(record)] = record
            requeued = index.lookup(ids)
            for prompt_id in ids:
                chosen = _choose(results.get(prompt_id), requeued.get(prompt_id),
                                 errors.get(prompt_id), report)
                if chosen is None:
                    if len(report.missing_ids) < MISSING_EXAMPLES:
                        report.missing_ids.append(prompt_id)
                    continue
                report.count(chosen)
                yield chosen


def _index_requeue_batch(sink: Sink, job: str, batch: str, layout: Layout, index: RequeueIndex,
                         report: Reconcile) -> None:
    if batch not in layout.done:
        # Queued or running: its prompts' earlier failure is no longer their outcome.
        raw = sink.get(keys.sink_input(job, batch)) or b""
        for line in raw.splitlines():
            if line:
                index.put(_input_key(line), PENDING, None)
        return
    # Errors come before results: a prompt in both (a retry after a crash between the two
    # writes) succeeded.
    for record in batch_records(sink, job, batch):
        if is_failure(record):
            index.put(record_key(record), FAILURE, orjson.dumps(record))
        elif not index.put(record_key(record), SUCCESS, orjson.dumps(record)):
            report.duplicates_dropped += 1


def _input_key(line: bytes) -> str:
    """The answer key of a batch input's line."""
    item = read_input_line(line)
    return answer_key(item["id"], item.get("sample"))


def _choose(result: OutputRecord | None, requeued: tuple[int, bytes | None] | None,
            error: OutputRecord | None, report: Reconcile) -> OutputRecord | None:
    """One id's outcome from its batch's result, its requeue index entry and its batch's error."""
    if result is not None:
        if requeued is not None and requeued[0] == SUCCESS:
            report.duplicates_dropped += 1
        return result
    if requeued is not None:
        state, record = requeued
        return None if state == PENDING or record is None else read_record(record)
    return error


def drain(rows: Iterable[OutputRecord]) -> None:
    """Run `rows` through without writing: the reconcile of an export that will be refused."""
    deque(rows, maxlen=0)

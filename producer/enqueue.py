"""`python -m producer enqueue`: validate, store batch inputs in the sink, queue what is left.

The whole file is validated before anything is written or queued, so a bad line never leaves a
half-enqueued job. Batch inputs go to `{output}/{job}/inputs/` (the sink holds everything the
job needs; Redis can be rebuilt from it) and batch boundaries are a pure function of the file
and the batch size, so re-running the same command resumes: batches already done or queued are
skipped.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
from celery import Celery

from producer.inputs import (
    NoPrompts,
    PromptRecord,
    Rejects,
    read_prompts,
    validate_file,
)
from workers import keys
from workers.dispatch import dispatch
from workers.errors import JobError
from workers.job import (
    TAPER,
    GenerationParams,
    InputInfo,
    JobManifest,
    batch_sizes,
    validate_job_name,
)
from workers.ledger import Ledger
from workers.sink import Sink, open_sink

log = logging.getLogger(__name__)

# Small jobs are cut into about this many batches so every GPU gets work and the job's last
# batches are small enough not to leave one GPU with a whole batch at the end; large ones stop
# at MAX_DEFAULT_BATCH prompts (~3 min of a B200 at 40 slots x 86 tok/s x 2.4k tokens). Two
# batches of at least MIN_DEFAULT_BATCH in flight per worker keep a 40-slot server full.
MIN_BATCHES = 64
MIN_DEFAULT_BATCH = 48
MAX_DEFAULT_BATCH = 256
UPLOAD_THREADS = 16


@dataclass(frozen=True)
class EnqueueRequest:
    path: Path
    job: str
    output: str
    params: GenerationParams
    queue: str = keys.SHARED_QUEUE
    batch_size: int | None = None
    skip_invalid: bool = False
    canary: dict[str, Any] = field(default_factory=dict)
    input_name: str | None = None  # the input in errors and the manifest (default: path)


@dataclass
class EnqueueReport:
    job: str
    prompts: int = 0
    batches: int = 0
    enqueued: int = 0
    skipped_done: int = 0
    skipped_queued: int = 0
    rejected: int = 0
    rejects_at: str | None = None
    resumed: bool = False
    notes: list[str] = field(default_factory=list)


def default_batch_size(prompts: int) -> int:
    return max(MIN_DEFAULT_BATCH, min(MAX_DEFAULT_BATCH, math.ceil(prompts / MIN_BATCHES)))


def enqueue(
    req: EnqueueRequest,
    ledger: Ledger,
    app: Celery,
    progress: Callable[[int, int], None] | None = None,
) -> EnqueueReport:
    validate_job_name(req.job)
    rejects = Rejects()
    on_error = rejects if req.skip_invalid else None
    summary = validate_file(req.path, progress=progress, on_error=on_error, name=req.input_name)
    if summary.prompts == 0:
        # A job of no prompts would be done the moment it exists and hold its name for good.
        raise NoPrompts(summary.path, summary.lines, summary.rejected, rejects.first)
    sink = open_sink(req.output)
    existing = ledger.load_job(req.job) if ledger.job_exists(req.job) else _manifest_from(sink, req.job)
    report = EnqueueReport(job=req.job, resumed=existing is not None)
    if existing is not None:
        manifest = _check_resume(existing, req, summary.sha256, report)
    else:
        size = req.batch_size or default_batch_size(summary.prompts)
        manifest = JobManifest(
            name=req.job,
            output=req.output,
            input=InputInfo(summary.path, summary.sha256, summary.lines, summary.bytes),
            prompts=summary.prompts,
            batch_size=size,
            batches=len(batch_sizes(summary.prompts, size, taper=TAPER)),
            taper=TAPER,
            queue=req.queue,
            params=req.params,
            rejected=summary.rejected,
            canary=req.canary,
        )
    if rejects.count:
        report.rejected = rejects.count
        report.rejects_at = sink.describe(f"{req.job}/rejects.jsonl")
        rejects.upload(sink, f"{req.job}/rejects.jsonl")
    sink.put(keys.sink_manifest(req.job), manifest.to_json())
    ledger.save_job(manifest)
    report.prompts, report.batches = manifest.prompts, manifest.batches
    _queue_batches(req, manifest, sink, ledger, app, report, progress)
    return report


def _manifest_from(sink: Sink, job: str) -> JobManifest | None:
    raw = sink.get(keys.sink_manifest(job))
    return JobManifest.from_json(raw) if raw else None


def _check_resume(
    existing: JobManifest, req: EnqueueRequest, sha256: str, report: EnqueueReport
) -> JobManifest:
    if existing.input.sha256 != sha256:
        raise JobError(
            f"job {req.job!r} was enqueued from a different input "
            f"({existing.input.path}, sha256 {existing.input.sha256[:12]}); this file is "
            f"sha256 {sha256[:12]}. Use a new --job name for a new input."
        )
    if existing.output.rstrip("/") != req.output.rstrip("/"):
        raise JobError(f"job {req.job!r} writes to {existing.output}, not {req.output}")
    if req.batch_size and req.batch_size != existing.batch_size:
        report.notes.append(
            f"--batch-size {req.batch_size} ignored: the job's batches are {existing.batch_size} "
            "prompts (batch boundaries must stay the same to resume)"
        )
    if req.params != existing.params:
        report.notes.append("generation parameters differ from the job's; the job's are kept")
    return existing


def _batches(
    path: Path, sizes: list[int], progress: Callable[[int, int], None] | None
) -> Iterator[tuple[str, list[PromptRecord]]]:
    chunk: list[PromptRecord] = []
    index = 0
    for record in read_prompts(path, skip_invalid=True, progress=progress):
        chunk.append(record)
        if len(chunk) == sizes[min(index, len(sizes) - 1)]:
            index += 1
            yield keys.batch_id(index), chunk
            chunk = []
    if chunk:
        yield keys.batch_id(index + 1), chunk


def _queue_batches(
    req: EnqueueRequest, manifest: JobManifest, sink: Sink, ledger: Ledger, app: Celery,
    report: EnqueueReport, progress: Callable[[int, int], None] | None = None,
) -> None:
    job = manifest.name
    done = ledger.done_batches(job)
    in_sink = {
        Path(k).stem for k in sink.list_keys(keys.sink_results_prefix(job)) if k.endswith(".jsonl")
    }
    if in_sink - done:
        ledger.rebuild_done(job, in_sink - done)
    done |= in_sink
    waiting = set(ledger.queued_batches(job)) | set(ledger.running_batches(job))
    pending: list[str] = []
    with ThreadPoolExecutor(UPLOAD_THREADS) as pool:
        uploads = []
        sizes = batch_sizes(manifest.prompts, manifest.batch_size, taper=manifest.taper)
        for batch, records in _batches(req.path, sizes, progress):
            if batch in done:
                report.skipped_done += 1
                continue
            if batch in waiting:
                report.skipped_queued += 1
                continue
            data = _input_bytes(manifest.params, records)
            uploads.append(pool.submit(sink.put, keys.sink_input(job, batch), data))
            pending.append(batch)
            if len(uploads) >= UPLOAD_THREADS * 4:
                _drain(uploads)
                report.enqueued += dispatch(app, ledger, job, pending, manifest.queue)
                pending = []
        _drain(uploads)
    report.enqueued += dispatch(app, ledger, job, pending, manifest.queue)


def _drain(uploads: list[Any]) -> None:
    for future in uploads:
        future.result()
    uploads.clear()


def _input_bytes(params: GenerationParams, records: list[PromptRecord]) -> bytes:
    return b"".join(
        orjson.dumps({"id": r.id, "line": r.line, "body": params.request_body(r.body)}) + b"\n"
        for r in records
    )


__all__ = ["EnqueueReport", "EnqueueRequest", "default_batch_size", "enqueue"]

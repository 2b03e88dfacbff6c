"""`python -m producer enqueue`: validate, store batch inputs in the sink, then start the job.

Creating a job is a transaction a user can interrupt:
1. the whole file is validated before anything is written, so a bad line never leaves a
   half-enqueued job;
2. one enqueue per job name at a time: a Redis lock (renewed while it runs, expiring soon after
   a killed process) makes a second one fail with "being created by another enqueue";
3. the manifest is stored with `complete: false` (job state `creating`: no worker, reconciler
   or export acts on it), then every batch input that is not in the sink yet is uploaded to
   `{output}/{job}/inputs/`, then the manifest is rewritten with `complete: true` — the last
   object written — and the job is set `running` and its batches are queued.
It reports its progress in three phases, in order: CHECKING (reading the whole input: every line
or row validated, its identity taken: a local file hashed, an S3 object's ETag), STORING (reading it again: each batch's input written to the sink;
only while the job is being created) and QUEUEING (sending the batches to the broker).
A prompt asking several answers (`sampling.n`, `--samples`) is stored as one work item per
answer (producer/answers.py); batches count answers.
A job makes one kind of request (fleetgen/endpoints.py): `EnqueueRequest.endpoint`, else the
one the input's first line names (an OpenAI Batch line's `url`), else chat; the manifest keeps
it. An embeddings job generates no text: no answers beyond one per prompt, no rollout, no
generation defaults in its bodies, and its canary (which judges text) is off.
Batch boundaries are a pure function of the file and the batch size, so running the same
command again resumes: an interrupted creation uploads exactly the inputs still missing, and a
running job queues only batches that are neither done nor waiting (running, or in the broker:
one marked queued that an interrupted run never sent is sent then). A job Redis lost (its
manifest is in the sink) has its ledger rebuilt from the sink first (producer/rebuild.py): its
requeue rounds run again too, and the report says what was rebuilt.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, cast

import orjson
from celery import Celery

from fleetgen import keys
from fleetgen.canary import Thresholds
from fleetgen.creation import creation_lock
from fleetgen.dispatch import dispatch
from fleetgen.endpoints import CHAT, EMBEDDINGS, ENDPOINTS, endpoint
from fleetgen.errors import JobError
from fleetgen.job import (
    TAPER,
    GenerationParams,
    InputInfo,
    JobManifest,
    batch_sizes,
    input_line,
    validate_job_name,
)
from fleetgen.ledger import Ledger
from fleetgen.rollouts import RolloutSpec
from fleetgen.sink import Sink, location, open_sink
from producer.answers import WorkItem, job_seed, work_items
from producer.inputs import (
    InputSource,
    NoPrompts,
    Rejects,
    local_input,
    read_prompts,
    validate_file,
)
from producer.rebuild import Rebuilt, count_written, rebuild
from producer.sinkview import stored_manifest

if TYPE_CHECKING:  # the servers' package loads httpx, which enqueue never needs
    from fleetgen.servers import RequestBody

log = logging.getLogger(__name__)

# Small jobs are cut into about this many batches so every GPU gets work and the job's last
# batches are small enough not to leave one GPU with a whole batch at the end; large ones stop
# at MAX_DEFAULT_BATCH prompts (~3 min of a B200 at 40 slots x 86 tok/s x 2.4k tokens). Two
# batches of at least MIN_DEFAULT_BATCH in flight per worker keep a 40-slot server full.
MIN_BATCHES = 64
MIN_DEFAULT_BATCH = 48
MAX_DEFAULT_BATCH = 256
# An embedding takes a GPU a fraction of a millisecond: batches of chat's size would cost a
# broker message, a lease and an object each few tens of milliseconds of GPU time. Embeddings
# batches hold a few seconds of a GPU instead (thousands of texts a second).
MIN_DEFAULT_EMBEDDINGS_BATCH = 1024
MAX_DEFAULT_EMBEDDINGS_BATCH = 8192
UPLOAD_THREADS = 16
# Batches sent to the broker between two progress reports.
QUEUE_CHUNK = 100

# The phases of `enqueue`, in order, as its progress callback names them: `progress(phase,
# done, total)` counts bytes of the file in the first two, batches in the last.
CHECKING = "checking"
STORING = "storing"
QUEUEING = "queueing"
Progress = Callable[[str, int, int], None]


class EnqueueInterrupted(Exception):
    """Ctrl-C or SIGTERM during enqueue; `report` says how far it got."""

    def __init__(self, report: EnqueueReport) -> None:
        super().__init__(report)
        self.report = report


@dataclass(frozen=True)
class EnqueueRequest:
    path: Path | InputSource  # a JSONL file, or an opened input (producer.inputs.open_input)
    job: str
    output: str
    params: GenerationParams
    queue: str = keys.SHARED_QUEUE
    batch_size: int | None = None
    skip_invalid: bool = False
    canary: Thresholds = field(default_factory=Thresholds)
    input_name: str | None = None  # the input in errors and the manifest (default: path)
    samples: int | None = None  # answers per prompt whose line gives no n (default 1)
    seed: int | None = None  # the job's seed (default: drawn from its name)
    # The program each prompt runs (one answer per prompt; a line's `n` is the rollout's).
    rollout: RolloutSpec | None = None
    # What each request asks (fleetgen/endpoints.py); None: what the input's first line names
    # (an OpenAI Batch line's url), else chat.
    endpoint: str | None = None


@dataclass
class EnqueueReport:
    job: str
    prompts: int = 0
    answers: int = 0
    batches: int = 0
    # Batch inputs stored by this run, and found already stored by an earlier one.
    uploaded: int = 0
    already_stored: int = 0
    complete: bool = False
    # Batches this run set out to queue, and those that reached the broker (on an interrupt:
    # those found there, running or done).
    to_queue: int = 0
    enqueued: int = 0
    skipped_done: int = 0
    skipped_queued: int = 0
    rejected: int = 0
    rejects_at: str | None = None
    resumed: bool = False
    notes: list[str] = field(default_factory=list)
    rebuilt: Rebuilt | None = None  # Redis did not know the job: its ledger, from the sink
    endpoint: str = CHAT  # the job's (fleetgen/endpoints.py)


def default_batch_size(prompts: int, endpoint: str = CHAT) -> int:
    """Prompts per batch when `--batch-size` is not given: about MIN_BATCHES batches, within
    the bounds of the job's kind of request."""
    low, high = ((MIN_DEFAULT_EMBEDDINGS_BATCH, MAX_DEFAULT_EMBEDDINGS_BATCH)
                 if not ENDPOINTS[endpoint].generates else (MIN_DEFAULT_BATCH, MAX_DEFAULT_BATCH))
    return max(low, min(high, math.ceil(prompts / MIN_BATCHES)))


def enqueue(
    req: EnqueueRequest,
    ledger: Ledger,
    app: Celery,
    progress: Progress | None = None,
) -> EnqueueReport:
    """Create or resume the job; raises EnqueueInterrupted (with what was done) on Ctrl-C."""
    validate_job_name(req.job)
    report = EnqueueReport(job=req.job)
    sending: list[str] = []
    try:
        _enqueue(req, ledger, app, progress or _silent, report, sending)
    except KeyboardInterrupt:
        if sending:
            # Ctrl-C may land in a send, or after the last one: the broker says what went.
            report.enqueued = _queued_now(ledger, req.job, sending)
        raise EnqueueInterrupted(report) from None
    return report


def _silent(phase: str, done: int, total: int) -> None:
    """No progress shown."""


def _file_pass(progress: Progress, phase: str, source: InputSource) -> Callable[[int, int], None]:
    """The input reader's callback (bytes read, lines read) as `phase`'s progress in bytes."""
    return lambda read, _lines: progress(phase, read, source.size)


def _source(req: EnqueueRequest) -> InputSource:
    if isinstance(req.path, InputSource):
        return req.path
    return local_input(req.path, req.input_name)


def _enqueue(
    req: EnqueueRequest, ledger: Ledger, app: Celery, progress: Progress,
    report: EnqueueReport, sending: list[str],
) -> None:
    sink = open_sink(req.output)
    _check_output(req.job, req.output, ledger, sink)
    rejects = Rejects()
    on_error = rejects if req.skip_invalid else None
    source = _source(req)
    if req.endpoint is not None:
        _check_endpoint(req, req.endpoint)  # before the input is read, when it is given
    summary = validate_file(source, progress=_file_pass(progress, CHECKING, source),
                            on_error=on_error, samples=req.samples or 1, endpoint=req.endpoint)
    _check_endpoint(req, summary.endpoint)
    if summary.ignored_columns:
        report.notes.append(f"columns passed over (no prompt field): "
                            f"{', '.join(summary.ignored_columns)}")
    if summary.prompts == 0:
        # A job of no prompts would be done the moment it exists and hold its name for good.
        raise NoPrompts(summary.path, summary.lines, summary.rejected, rejects.first)
    # The job's ledger shard, before its lock (which lives there): a resume keeps its own.
    ledger.shards.place(req.job)
    with creation_lock(ledger, req.job):
        known = ledger.jobs.exists(req.job)
        existing = ledger.jobs.load(req.job) if known else stored_manifest(sink, req.job)
        report.resumed = existing is not None
        if existing is not None:
            manifest = _check_resume(existing, req, summary.sha256, summary.endpoint, report)
        else:
            # A rollout job has one answer per prompt: a line's `n` is for its rollout.
            answers = summary.prompts if req.rollout is not None else summary.answers
            size = req.batch_size or default_batch_size(answers, summary.endpoint)
            sampled = answers != summary.prompts
            manifest = JobManifest(
                name=req.job,
                output=req.output,
                input=InputInfo(summary.path, summary.sha256, summary.lines, summary.bytes),
                prompts=summary.prompts,
                batch_size=size,
                batches=len(batch_sizes(answers, size, taper=TAPER)),
                taper=TAPER,
                queue=req.queue,
                params=req.params,
                rejected=summary.rejected,
                # The canary judges answers' text; an embeddings job's vectors have none.
                canary=req.canary if endpoint(summary.endpoint).generates
                else Thresholds(enabled=False),
                complete=False,
                answers=answers,
                samples=req.samples or 1,
                seed=job_seed(req.job, req.seed) if sampled else None,
                rollout=asdict(req.rollout) if req.rollout is not None else None,
                endpoint=summary.endpoint,
            )
        report.endpoint = manifest.endpoint
        report.prompts, report.batches = manifest.prompts, manifest.batches
        report.answers = manifest.answers
        if rejects.count:
            report.rejected = rejects.count
            report.rejects_at = sink.describe(f"{req.job}/rejects.jsonl")
            rejects.upload(sink, f"{req.job}/rejects.jsonl")
        if manifest.complete and known:
            report.complete = True
            ledger.jobs.save(manifest)
            pending = _pending_batches(manifest, sink, ledger, report)
        elif manifest.complete:
            report.complete = True
            # Redis lost the job: its ledger is rebuilt from the sink, requeue rounds included.
            report.rebuilt = rebuild(ledger, manifest, sink)
            pending = _pending_batches(manifest, sink, ledger, report)
        else:
            manifest = _store_inputs(source, req.endpoint, manifest, sink, ledger, report,
                                     progress)
            pending = _pending_batches(manifest, sink, ledger, report)
            # Queued in the ledger before the job runs, so no reconciler round sees them in no
            # state and sends them a second time.
            ledger.batches.mark_queued_and_settle(manifest.name, pending)
            ledger.jobs.activate(manifest)
            ledger.jobs.note_inputs_stored(manifest.name, None)
            report.complete = True
        report.to_queue = len(pending)
        sending.extend(pending)
        progress(QUEUEING, 0, len(pending))
        for start in range(0, len(pending), QUEUE_CHUNK):
            chunk = pending[start:start + QUEUE_CHUNK]
            report.enqueued += dispatch(app, ledger, manifest.name, chunk, manifest.queue)
            progress(QUEUEING, report.enqueued, len(pending))


def _check_output(job: str, output: str, ledger: Ledger, sink: Sink) -> None:
    """JobError unless the job's folder `{output}/{job}/` and every other job's lie apart: a job
    inside another's folder would have its objects read as that job's (a job `results` in job
    A's folder is A's results). The others are the jobs Redis knows and any job whose
    manifest.json is in the output's folder or one above it."""
    mine = location(output) + job + "/"
    for name, theirs in _job_folders(ledger):
        if name == job:
            continue
        if mine.startswith(theirs):
            raise JobError(f"--output {output} puts job {job!r} at {mine}, inside job {name!r} "
                           f"at {theirs}; choose an --output outside every job's folder")
        if theirs.startswith(mine):
            raise JobError(f"--output {output} puts job {job!r} at {mine}, around job {name!r} "
                           f"at {theirs}; choose another --output or --job")
    for where, raw in sink.manifests_above():
        try:
            other = JobManifest.from_json(raw)
        except (JobError, orjson.JSONDecodeError):
            continue  # some other tool's manifest.json
        folder = PurePosixPath(where).parent
        if other.name == folder.name:
            raise JobError(f"--output {output} puts job {job!r} at {mine}, inside job "
                           f"{other.name!r} at {where.removesuffix(keys.SINK_MANIFEST)} (its "
                           "manifest.json is there); choose an --output outside every job's folder")


def _job_folders(ledger: Ledger) -> Iterator[tuple[str, str]]:
    """(name, `{output}/{job}/` as `location` spells it) of every job Redis holds."""
    names = ledger.jobs.names()
    for name, raw in zip(names, ledger.jobs.manifests_raw(names), strict=True):
        if raw is not None:
            yield name, location(orjson.loads(raw)["output"]) + name + "/"


def _check_endpoint(req: EnqueueRequest, name: str) -> None:
    """JobError when the request asks what a job of endpoint `name` cannot do: a rollout's
    calls are chat requests; an embeddings request gives one vector per text, the same every
    time, so it has no answers to count, no sampling and no canary."""
    kind = endpoint(name)
    if req.rollout is not None and name != CHAT:
        raise JobError(f"--rollout with {name} ({kind.path}): a rollout's calls are chat "
                       "requests")
    if kind.generates:
        return
    why = f"{'an' if name == EMBEDDINGS else 'a'} {name} job ({kind.path}) generates no text"
    if req.samples is not None and req.samples > 1:
        raise JobError(f"--samples {req.samples}: {why}; each text gets one answer (a vector, "
                       "a label), the same every time")
    if req.canary != Thresholds() and req.canary.enabled:
        raise JobError(f"--canary: {why}, which the canary judges; its canary is off")
    if replace(req.params, model=None) != GenerationParams():
        raise JobError(f"--max-tokens, --temperature, --top-p and --no-thinking: {why}; leave "
                       "them out")


def _check_resume(
    existing: JobManifest, req: EnqueueRequest, sha256: str, endpoint_name: str,
    report: EnqueueReport,
) -> JobManifest:
    if existing.input.sha256 != sha256:
        raise JobError(
            f"job {req.job!r} was enqueued from a different input "
            f"({existing.input.path}, sha256 {existing.input.sha256[:12]}); this input is "
            f"sha256 {sha256[:12]}. Use a new --job name for a new input."
        )
    if existing.output.rstrip("/") != req.output.rstrip("/"):
        raise JobError(f"job {req.job!r} writes to {existing.output}, not {req.output}")
    if existing.endpoint != endpoint_name:
        raise JobError(
            f"job {req.job!r} makes {existing.endpoint} requests ({existing.kind.path}), not "
            f"{endpoint_name} ({endpoint(endpoint_name).path}); a job makes one kind of request "
            "for all its prompts: resume it as it was enqueued, or use a new --job name")
    if req.batch_size and req.batch_size != existing.batch_size:
        report.notes.append(
            f"--batch-size {req.batch_size} ignored: the job's batches are {existing.batch_size} "
            "prompts (batch boundaries must stay the same to resume)"
        )
    if req.params != existing.params:
        report.notes.append("generation parameters differ from the job's; the job's are kept")
    given = asdict(req.rollout) if req.rollout is not None else None
    if given != existing.rollout:
        theirs = existing.rollout_spec
        raise JobError(
            f"job {req.job!r} runs "
            + (f"rollout {theirs.name} (module sha256 {theirs.digest[:12]})" if theirs
               else "no rollout")
            + ", not " + (f"{req.rollout.name} (sha256 {req.rollout.digest[:12]})"
                          if req.rollout is not None else "none")
            + "; a job runs one program for all its prompts: resume it as it was enqueued, "
            "or use a new --job name")
    if (req.samples is not None and req.samples != existing.samples) or (
            req.seed is not None and req.seed != existing.seed):
        report.notes.append(f"--samples/--seed ignored: the job's are {existing.samples} answers "
                            f"per prompt and seed {existing.seed} (its inputs must stay the same "
                            "to resume)")
    return existing


def _batches(
    source: InputSource, given: str | None, manifest: JobManifest, sizes: list[int],
    progress: Progress,
) -> Iterator[tuple[str, list[WorkItem]]]:
    """The job's batches of work items, read again as the check read them (`given`: the
    endpoint it was given, so both passes read the same lines)."""
    chunk: list[WorkItem] = []
    index = 0
    reading = _file_pass(progress, STORING, source)
    for record in read_prompts(source, skip_invalid=True, progress=reading, endpoint=given):
        for item in work_items(record, samples=manifest.samples, seed=manifest.seed,
                               sampled=manifest.sampled, keep_n=manifest.rollout is not None):
            chunk.append(item)
            if len(chunk) == sizes[min(index, len(sizes) - 1)]:
                index += 1
                yield keys.batch_id(index), chunk
                chunk = []
    if chunk:
        yield keys.batch_id(index + 1), chunk


def _store_inputs(
    source: InputSource, given: str | None, manifest: JobManifest, sink: Sink, ledger: Ledger,
    report: EnqueueReport, progress: Progress,
) -> JobManifest:
    """Upload every batch input the sink lacks, then store the complete manifest in the sink
    (its last object); returns it. The caller sets the job running."""
    job = manifest.name
    # The intent first, in both places: a later enqueue (even after a Redis loss) finds the
    # file's sha256 and resumes instead of mixing two inputs.
    sink.put(keys.sink_manifest(job), manifest.to_json())
    ledger.jobs.save(manifest)
    stored = {Path(k).stem for k in sink.list_keys(f"{job}/inputs/") if k.endswith(".jsonl")}
    sizes = batch_sizes(manifest.answers, manifest.batch_size, taper=manifest.taper)
    uploads: list[Future[None]] = []
    try:
        with ThreadPoolExecutor(UPLOAD_THREADS) as pool:
            for batch, records in _batches(source, given, manifest, sizes, progress):
                if batch in stored:
                    report.already_stored += 1
                    continue
                data = _input_bytes(manifest, records)
                uploads.append(pool.submit(sink.put, keys.sink_input(job, batch), data))
                if len(uploads) >= UPLOAD_THREADS * 4:
                    report.uploaded += _drain(uploads)
                    ledger.jobs.note_inputs_stored(job, report.uploaded + report.already_stored)
            report.uploaded += _drain(uploads)
    finally:
        # Interrupted: the pool still finished the uploads it was given; they are stored.
        report.uploaded += sum(1 for f in uploads if not f.cancelled() and f.exception() is None)
        # The count `status` shows of a job whose enqueue stopped is the one its message said.
        ledger.jobs.note_inputs_stored(job, report.uploaded + report.already_stored)
    complete = replace(manifest, complete=True)
    sink.put(keys.sink_manifest(job), complete.to_json())
    return complete


def _pending_batches(
    manifest: JobManifest, sink: Sink, ledger: Ledger, report: EnqueueReport
) -> list[str]:
    """The job's batches that are neither done (in the sink) nor waiting (running, or in the
    broker). One the ledger marks queued that is in no broker list was never sent (its
    enqueue was interrupted before the send) or its message was lost: it is pending too."""
    job = manifest.name
    in_sink = {Path(k).stem for k in sink.list_keys(keys.sink_results_prefix(job))
               if k.endswith(".jsonl") and keys.is_batch(Path(k).stem)}
    # Written but not recorded (Redis lost it, or its worker died first): counted from the sink.
    done = count_written(ledger, sink, job, in_sink)
    waiting = set(ledger.batches.running(job)) | _in_broker(ledger, job, ledger.batches.queued(job))
    pending = []
    for batch in ledger.jobs.batches(job):
        if batch in done:
            report.skipped_done += 1
        elif batch in waiting:
            report.skipped_queued += 1
        else:
            pending.append(batch)
    return pending


def _in_broker(ledger: Ledger, job: str, batches: Iterable[str]) -> set[str]:
    """Those of `batches` with a message in a broker list or held unacked by a worker (the
    broker is read only when there are some)."""
    wanted = set(batches)
    if not wanted:
        return set()
    return {b for j, b in ledger.batches.in_broker() if j == job} & wanted


def _queued_now(ledger: Ledger, job: str, batches: list[str]) -> int:
    """How many of `batches` reached the broker: in it, running or done."""
    gone = set(ledger.batches.running(job)) | ledger.batches.done(job)
    return len(_in_broker(ledger, job, batches) | (gone & set(batches)))


def _drain(uploads: list[Future[None]]) -> int:
    count = len(uploads)
    for future in uploads:
        future.result()
    uploads.clear()
    return count


def _input_bytes(manifest: JobManifest, items: list[WorkItem]) -> bytes:
    return b"".join(orjson.dumps(input_line(i.id, i.line, _stored_body(manifest, i.body),
                                            i.sample)) + b"\n" for i in items)


def _stored_body(manifest: JobManifest, body: RequestBody) -> RequestBody:
    """The body a batch input keeps: the job's generation defaults under the line's values; an
    embeddings body takes none of them, only the job's model when it names one."""
    if manifest.kind.generates:
        return manifest.params.request_body(body)
    model = manifest.params.model
    return cast("RequestBody", {"model": model, **body}) if model else body


__all__ = [
    "CHECKING",
    "QUEUEING",
    "STORING",
    "EnqueueInterrupted",
    "EnqueueReport",
    "EnqueueRequest",
    "Progress",
    "default_batch_size",
    "enqueue",
]

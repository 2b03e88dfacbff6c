"""Steering a running job: pause, resume, cancel, and re-drive failed prompts.

Pause and cancel stop new batches from starting (workers ack and drop their deliveries);
running batches of a paused job finish, those of a cancelled job stop at their next heartbeat
with their finished prompts kept in the checkpoint. Resume re-dispatches every batch that is
neither done, nor running, nor waiting in the broker; after a failure breaker pause it first
sends the prompts that failed with the breaker's cause again (fleetgen/breaker.py). Each of the
three records the job's new state in its output at once (progress.json), so a rebuild after
Redis lost the job keeps a pause or a cancel (producer/rebuild.py).

`requeue --failed` finds the failed prompts in the job's one reading (producer/sinkview.py, as
`export` does), numbers its round past every round the ledger or the sink knows, and holds the
job's lock (fleetgen/creation.py) from the reading to the round's record, so two requeues at once
cannot send the same prompts twice.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass

import orjson
from celery import Celery
from tenacity import RetryError, Retrying, retry_if_result, stop_before_delay

from fleetgen import breaker, keys
from fleetgen.creation import JOB_LOCK_WAIT_S, job_lock
from fleetgen.dispatch import dispatch
from fleetgen.errors import JobError
from fleetgen.job import InputLine, JobManifest
from fleetgen.ledger import STATE_CANCELLED, STATE_CREATING, STATE_PAUSED, STATE_RUNNING, Ledger
from fleetgen.progress import record_state
from fleetgen.records import OutputRecord, answer_key, is_failure, record_key
from fleetgen.retry import backoff
from fleetgen.sink import Sink, open_sink, stored_inputs
from producer import sinkview
from producer.rebuild import count_written


def pause(ledger: Ledger, job: str, reason: str = "paused by user") -> None:
    _created(ledger, job)
    ledger.jobs.set_state(job, STATE_PAUSED, reason)
    record_state(ledger, job, time.time())


def cancel(ledger: Ledger, job: str) -> None:
    _created(ledger, job)
    ledger.jobs.set_state(job, STATE_CANCELLED, "cancelled by user")
    record_state(ledger, job, time.time())


def _created(ledger: Ledger, job: str) -> JobManifest:
    """The job's manifest; JobError while its enqueue has not finished (nothing runs yet)."""
    manifest = ledger.jobs.load(job)
    if ledger.jobs.state(job)[0] == STATE_CREATING:
        raise JobError(f"job {job} is still being created: nothing runs until its enqueue "
                       "finishes (run the same enqueue command again if it was interrupted)")
    return manifest


@dataclass
class Resumed:
    """What `resume` did."""

    batches: int  # dispatched again
    cause: str | None = None  # the failure breaker's cause, when it had paused the job
    resent: int = 0  # prompts that failed with it, sent again
    accepted: bool = False  # --accept-failures: they stay failures


def resume(ledger: Ledger, app: Celery, job: str, *, accept_quality: bool = False,
           accept_failures: bool = False, wait_s: float = 30.0) -> Resumed:
    """Set the job running again and re-dispatch what nobody is working on.

    A job the failure breaker paused first gets back the prompts that failed with its cause:
    once no batch of it runs (waiting up to `wait_s`, JobError past it), they leave the
    checkpoints of batches not written yet, whose next run sends them again, and those of
    written batches go out in new batches (`requeue_failed`). With `accept_failures` they stay
    failures, and the breaker no longer trips on that cause for the job.
    """
    manifest = _created(ledger, job)
    state, reason = ledger.jobs.state(job)
    if state == STATE_PAUSED and reason.startswith("quality:") and not accept_quality:
        raise JobError(
            f"job {job} was paused by the quality canary ({reason}); look at the examples in "
            f"`python -m producer status {job}`, then resume with --accept-quality to go on anyway"
        )
    cause = None
    if state == STATE_PAUSED and reason.startswith(breaker.REASON_PREFIX):
        cause = ledger.guards.breaker_cause(job)
    resend = cause is not None and not accept_failures
    # Sending failures again is a requeue: it holds the job's lock as `requeue_failed` does.
    with job_lock(ledger, job, "resume", wait_s=JOB_LOCK_WAIT_S) if resend else nullcontext():
        resent: set[str] = set()
        if cause is not None and accept_failures:
            accepted = breaker.accepted_causes(ledger.guards.accepted_causes_raw(job))
            ledger.guards.accept_causes(job, {*accepted, cause})
        elif cause is not None:
            _wait_idle(ledger, job, wait_s)
            resent = _resend_checkpointed(ledger, manifest, cause)
        if accept_quality:
            ledger.guards.accept_quality(job, time.time())
        if cause is not None:
            # A fresh window: the old outcomes are settled, either way.
            ledger.guards.clear_breaker_window(job)
        ledger.jobs.set_state(job, STATE_RUNNING)
        record_state(ledger, job, time.time())
        resumed = Resumed(0, cause, len(resent), accepted=cause is not None and accept_failures)
        if resend:
            resumed.resent += _requeue(
                ledger, app, job, None, keep=lambda error: (breaker.outcome(error) == cause
                                                            and record_key(error) not in resent)
            ).prompts
    resumed.batches = redispatch_idle(ledger, app, job, manifest.queue)
    return resumed


def _wait_idle(ledger: Ledger, job: str, wait_s: float) -> None:
    """Until no live worker holds a batch of the paused job (its batches finish the requests
    they have in flight, then go back); JobError past `wait_s`, with nothing changed."""
    def held() -> list[str]:
        return sorted(b for b in ledger.batches.running(job) if ledger.leases.alive(job, b))

    try:
        Retrying(retry=retry_if_result(bool), stop=stop_before_delay(wait_s),
                 wait=backoff(0.1, 1.0))(held)
    except RetryError as exc:
        still = exc.last_attempt.result()
        raise JobError(
            f"job {job}: {len(still)} batches still run after {wait_s:.0f}s ({', '.join(still[:5])}"
            f"{', ...' if len(still) > 5 else ''}): they finish the requests they have at the "
            "servers, then stop. Nothing was changed: run resume again once `status` shows "
            "0 running") from None


def _resend_checkpointed(ledger: Ledger, manifest: JobManifest, cause: str) -> set[str]:
    """Take the prompts that failed with `cause` out of the checkpoints of batches not written
    yet, so that their next run sends them again; returns their ids."""
    job = manifest.name
    done = ledger.batches.done(job)
    sink: Sink | None = None
    ids: set[str] = set()
    for batch in ledger.jobs.batches(job):
        if batch in done:
            continue
        failed = [r for r in ledger.batches.checkpoint(job, batch).values()
                  if is_failure(r) and breaker.outcome(r) == cause]
        if not failed:
            continue
        sink = sink or open_sink(manifest.output)
        if sink.exists(keys.sink_result(job, batch)):
            # Written, its worker gone before recording it: the batch's next run records it
            # from the sink, and its failures go out in new batches with the written ones.
            continue
        if ledger.batches.drop_failures(job, batch, failed) is None:
            raise JobError(f"job {job}: batch {batch} started while resume ran; run resume again")
        ids.update(record_key(r) for r in failed)
    return ids


def redispatch_idle(ledger: Ledger, app: Celery, job: str, queue: str) -> int:
    done = ledger.batches.done(job)
    running = ledger.batches.running(job)
    waiting = {b for j, b in ledger.batches.in_broker() if j == job}
    idle = [b for b in ledger.jobs.batches(job) if b not in done and b not in running and b not in waiting]
    return dispatch(app, ledger, job, idle, queue)


@dataclass
class RequeueReport:
    prompts: int
    batches: int
    round: int = 0  # its number (0: nothing requeued)


def requeue_failed(
    ledger: Ledger, app: Celery, job: str, batch_size: int | None = None,
    keep: Callable[[OutputRecord], bool] | None = None,
) -> RequeueReport:
    """Send failed prompts again as new batches (e.g. after raising the context length); with
    `keep`, only those whose newest error line it keeps.

    Holds the job's lock: a second requeue meanwhile waits, then finds these prompts requeued
    already. Their earlier error lines stay in the sink; export keeps each prompt's newest
    outcome.
    """
    with job_lock(ledger, job, "requeue", wait_s=JOB_LOCK_WAIT_S):
        return _requeue(ledger, app, job, batch_size, keep)


def _requeue(
    ledger: Ledger, app: Celery, job: str, batch_size: int | None,
    keep: Callable[[OutputRecord], bool] | None,
) -> RequeueReport:
    """`requeue_failed` under the job's lock."""
    manifest = _created(ledger, job)
    sink = open_sink(manifest.output)
    failed: dict[str, str] = {}  # answer key -> the code of its newest outcome, a failure

    def collect(record: OutputRecord) -> None:
        if is_failure(record) and (keep is None or keep(record)):
            failed[record_key(record)] = record["error"]["code"]

    # The job's one reading: a prompt of a requeue batch not written yet has no outcome (its
    # round will give it one), so it is not requeued twice.
    layout, _ = sinkview.read(sink, manifest, collect)
    known = set(ledger.jobs.batches(job))
    unknown = [b for b in layout.requeue if b not in known]
    if unknown:
        raise JobError(
            f"job {job}: the output holds requeue batches the ledger does not know "
            f"({', '.join(unknown[:3])}{', ...' if len(unknown) > 3 else ''}): a requeue "
            f"stopped half way, or Redis lost writes. Run `python -m producer rebuild {job}`, "
            "then requeue again")
    # Written batches the ledger has not counted yet are counted first, so that taking their
    # failures out of the figures below never takes out what was never added.
    count_written(ledger, sink, job, layout.done)
    if not failed:
        return RequeueReport(0, 0)
    size = batch_size or manifest.batch_size
    round_no = ledger.rounds.next(job, layout.last_round)
    rows = _input_rows(sink, job, failed)
    batches: list[str] = []
    for start in range(0, len(rows), size):
        batch = keys.requeue_batch_id(round_no, start // size + 1)
        chunk = rows[start:start + size]
        sink.put(keys.sink_input(job, batch), b"".join(orjson.dumps(r) + b"\n" for r in chunk))
        batches.append(batch)
    ledger.rounds.record(job, batches, Counter(failed[_row_key(row)] for row in rows))
    if ledger.jobs.state(job)[0] == STATE_CANCELLED:
        ledger.jobs.set_state(job, STATE_RUNNING)
        record_state(ledger, job, time.time())
    dispatch(app, ledger, job, batches, manifest.queue)
    return RequeueReport(len(rows), len(batches), round_no)


def _input_rows(sink: Sink, job: str, wanted: dict[str, str]) -> list[InputLine]:
    """The stored input rows of the `wanted` answer keys (their first copy), in input order."""
    rows: dict[str, InputLine] = {}
    for row in stored_inputs(sink, job):
        key = _row_key(row)
        if key in wanted:
            rows.setdefault(key, row)
    return list(rows.values())


def _row_key(row: InputLine) -> str:
    """The answer key of a batch input's row."""
    return answer_key(row["id"], row.get("sample"))

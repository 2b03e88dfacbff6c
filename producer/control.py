"""Steering a running job: pause, resume, cancel, and re-drive failed prompts.

Pause and cancel stop new batches from starting (workers ack and drop their deliveries);
running batches of a paused job finish, those of a cancelled job stop at their next heartbeat
with their finished prompts kept in the checkpoint. Resume re-dispatches every batch that is
neither done, nor running, nor waiting in the broker.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import orjson
from celery import Celery

from workers import keys
from workers.dispatch import dispatch
from workers.errors import JobError
from workers.job import JobManifest
from workers.ledger import STATE_CANCELLED, STATE_CREATING, STATE_PAUSED, STATE_RUNNING, Ledger
from workers.reconciler import broker_batches
from workers.sink import Sink, iter_jsonl, open_sink


def pause(ledger: Ledger, job: str, reason: str = "paused by user") -> None:
    _created(ledger, job)
    ledger.set_state(job, STATE_PAUSED, reason)


def cancel(ledger: Ledger, job: str) -> None:
    _created(ledger, job)
    ledger.set_state(job, STATE_CANCELLED, "cancelled by user")


def _created(ledger: Ledger, job: str) -> JobManifest:
    """The job's manifest; JobError while its enqueue has not finished (nothing runs yet)."""
    manifest = ledger.load_job(job)
    if ledger.job_state(job)[0] == STATE_CREATING:
        raise JobError(f"job {job} is still being created: nothing runs until its enqueue "
                       "finishes (run the same enqueue command again if it was interrupted)")
    return manifest


def resume(ledger: Ledger, app: Celery, job: str, *, accept_quality: bool = False) -> int:
    """Set the job running again and re-dispatch what nobody is working on; returns that count."""
    manifest = _created(ledger, job)
    state, reason = ledger.job_state(job)
    if state == STATE_PAUSED and reason.startswith("quality:") and not accept_quality:
        raise JobError(
            f"job {job} was paused by the quality canary ({reason}); look at the examples in "
            f"`python -m producer status {job}`, then resume with --accept-quality to go on anyway"
        )
    if accept_quality:
        ledger.r.hset(keys.job(job), "quality_accepted", time.time())
    ledger.set_state(job, STATE_RUNNING)
    return redispatch_idle(ledger, app, job, manifest.queue)


def redispatch_idle(ledger: Ledger, app: Celery, job: str, queue: str) -> int:
    done = ledger.done_batches(job)
    running = ledger.running_batches(job)
    waiting = {b for j, b in broker_batches(ledger.r, grace_s=float("inf")) if j == job}
    idle = [b for b in ledger.all_batches(job) if b not in done and b not in running and b not in waiting]
    return dispatch(app, ledger, job, idle, queue)


@dataclass
class RequeueReport:
    prompts: int
    batches: int


def requeue_failed(ledger: Ledger, app: Celery, job: str, batch_size: int | None = None) -> RequeueReport:
    """Send failed prompts again as new batches (e.g. after raising the context length).

    Their earlier error lines stay in the sink; export keeps each prompt's latest outcome.
    """
    manifest = _created(ledger, job)
    sink = open_sink(manifest.output)
    failed = _failed_ids(sink, job)
    # Prompts of an earlier round that has not been written yet are requeued already.
    done = ledger.done_batches(job)
    for batch in sorted(b for b in ledger.all_batches(job) if b.startswith("r") and b not in done):
        for row in iter_jsonl(sink, keys.sink_input(job, batch)):
            failed.pop(row["id"], None)
    if not failed:
        return RequeueReport(0, 0)
    size = batch_size or manifest.batch_size
    round_no = int(ledger.r.hincrby(keys.job(job), "requeue_rounds", 1))
    rows = _input_rows(sink, job, failed)
    batches: list[str] = []
    for start in range(0, len(rows), size):
        batch = f"r{round_no:02d}-{start // size + 1:06d}"
        chunk = rows[start:start + size]
        sink.put(keys.sink_input(job, batch), b"".join(orjson.dumps(r) + b"\n" for r in chunk))
        batches.append(batch)
    by_code = Counter(failed[row["id"]] for row in rows)
    with ledger.r.pipeline() as p:
        p.sadd(keys.job_part(job, "extra"), *batches)
        # They leave the failed figures until their new batches are written; live and
        # written counters move together so `checkpointed` stays right.
        for part in ("stats", "written"):
            p.hincrbyfloat(keys.job_part(job, part), "prompts_failed", -len(rows))
            for code, n in by_code.items():
                p.hincrbyfloat(keys.job_part(job, part), f"error_{code}", -n)
        p.hincrbyfloat(keys.job_part(job, "stats"), "prompts_requeued", len(rows))
        p.execute()
    if ledger.job_state(job)[0] == STATE_CANCELLED:
        ledger.set_state(job, STATE_RUNNING)
    dispatch(app, ledger, job, batches, manifest.queue)
    return RequeueReport(len(rows), len(batches))


def _failed_ids(sink: Sink, job: str) -> dict[str, str]:
    """Id -> error code of the ids whose latest outcome is a failure (a later success clears
    an earlier error; errors objects are read in key order, so a later round's error wins)."""
    failed = {err["custom_id"]: err["error"]["code"]
              for err in iter_jsonl(sink, keys.sink_errors_prefix(job))}
    for res in iter_jsonl(sink, keys.sink_results_prefix(job)):
        failed.pop(res["id"], None)
    return failed


def _input_rows(sink: Sink, job: str, wanted: dict[str, str]) -> list[dict[str, Any]]:
    """The stored input rows of the `wanted` ids (their first copy), in input order."""
    rows: dict[str, dict[str, Any]] = {}
    for row in iter_jsonl(sink, f"{job}/inputs/"):
        if row["id"] in wanted:
            rows.setdefault(row["id"], row)
    return list(rows.values())

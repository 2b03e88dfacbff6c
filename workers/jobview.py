"""A job's progress in one view: counts, rate, ETA, tokens, finish reasons, quality, GPUs.

`job_status` gathers the figures into one dict: the `producer status --json` form and what
`progress.json` holds (workers/progress.py; field names are stable, new ones may be added).
With `live=True` it also reads every registered server (workers/fleet.py) for the per-GPU
table. It lives with the workers because their reconciler writes progress.json; the producer
prints it (producer/status.py `render`).

    status = job_status(ledger, "distill-v1", live=True)
"""

from __future__ import annotations

import time
from typing import Any

import orjson

from workers import keys
from workers.canary import Thresholds
from workers.creation import creation_holder
from workers.fleet import read_fleet, registry
from workers.job import JobManifest, batch_sizes
from workers.ledger import STATE_CREATING, STATE_RUNNING, Ledger

RATE_WINDOW_S = 300
STATE_DONE = "done"
# Work waiting, nothing running and nothing written for this long: the job is stalled
# (a live worker takes a queued batch within a second).
STALLED_AFTER_S = 30.0
STALLED_EXPLAINED_AFTER_S = 10.0
# A worker's last error is shown for this long after it happened.
ERROR_SHOWN_FOR_S = 3600.0


def job_status(
    ledger: Ledger, job: str, now: float | None = None, *, live: bool = False,
) -> dict[str, Any]:
    """Every figure of `job` at `now`; `live` adds `fleet` (one row per worker, ~2 s at most)."""
    now = time.time() if now is None else now
    manifest = ledger.load_job(job)
    stored_state, reason = ledger.job_state(job)
    # done/failed are what the sink holds (the figures export reconciles); prompts answered
    # in batches not written yet are `checkpointed` until their batch is written.
    written, stats, finished_batches, extra = ledger.counts(job)
    done = int(written.get("prompts_done", 0))
    failed = int(written.get("prompts_failed", 0))
    answered = int(stats.get("prompts_done", 0) + stats.get("prompts_failed", 0))
    remaining = max(0, manifest.prompts - done - failed)
    checkpointed = min(remaining, max(0, answered - done - failed))
    total_batches = manifest.batches + extra
    finished = finished_batches >= total_batches and stored_state == STATE_RUNNING
    state = STATE_DONE if finished else stored_state
    running = ledger.running_batches(job)
    in_hand = min(remaining - checkpointed, _in_hand(ledger, manifest, running))
    # One read of the registry: what the live workers have in flight and their last errors.
    entries = registry(ledger.r, now)
    in_flight = min(in_hand, _sent(entries))
    waiting = remaining - checkpointed - in_hand
    times = _times(ledger, job, manifest.created_at)
    clock = _clock(_minutes(ledger, job), times, now, finished)
    rate = _rates(clock, answered, stats.get("output_tokens", 0.0))
    workers = _workers(ledger, job)
    worker_errors = _worker_errors(entries, now)
    queued = waiting if state == STATE_RUNNING else 0
    return {
        "job": job,
        "state": state,
        "reason": reason or _creating_reason(ledger, manifest, state),
        "output": manifest.output,
        "total": manifest.prompts,
        "done": done,
        "failed": failed,
        "checkpointed": checkpointed,
        "in_flight": in_flight,
        "in_hand": in_hand,
        "queued": queued,
        # Not started because the job is paused, cancelled or still being created.
        "held": waiting if state not in (STATE_RUNNING, STATE_DONE) else 0,
        "batches": {"total": total_batches, "done": finished_batches,
                    "running": len(running), "queued": len(ledger.queued_batches(job))},
        "elapsed_s": round(clock["elapsed"], 1),
        "rate": rate,
        "eta_s": _eta(remaining - checkpointed, state, rate),
        "tokens": _tokens(stats, int(stats.get("prompts_done", 0))),
        "finish_reasons": _prefixed(stats, "finish_"),
        "errors": _prefixed(written, "error_"),
        "empty_content": int(stats.get("empty_content", 0)),
        "bytes_written": int(stats.get("bytes_written", 0)),
        "workers": workers,
        "canary": _canary(ledger, job, manifest),
        "quality": _quality(ledger, job),
        "worker_errors": worker_errors,
        "stalled": _stalled(manifest, entries, worker_errors, queued, len(running), times, now),
        "fleet": read_fleet(ledger.r, workers, clock["elapsed"], now=now)
        if live else None,
        "updated_at": now,
    }


def _sent(entries: dict[str, dict[str, Any]]) -> int:
    """Requests the live workers have at their servers right now (their registry entries)."""
    return sum(int(entry.get("in_flight") or 0) for entry in entries.values()
               if entry.get("state") != "lost")


def _in_hand(ledger: Ledger, manifest: JobManifest, running: dict[str, float]) -> int:
    """Prompts of running batches that have not reached the checkpoint yet (sent or waiting)."""
    with ledger.r.pipeline(transaction=False) as p:
        for batch in running:
            p.hlen(keys.checkpoint(manifest.name, batch))
        checkpointed = p.execute()
    plan = batch_sizes(manifest.prompts, manifest.batch_size, taper=manifest.taper)
    sizes = sum(_batch_len(plan, manifest.batch_size, b) for b in running)
    return max(0, sizes - sum(int(n) for n in checkpointed))


def _batch_len(plan: list[int], size: int, batch: str) -> int:
    """Prompts in an enqueued batch `bNNNNNN`; a requeue batch (`rNN-NNNNNN`) counts as full."""
    if not batch.startswith("b"):
        return size
    index = int(batch[1:] or 0)
    return plan[index - 1] if 0 < index <= len(plan) else 0


def _minutes(ledger: Ledger, job: str) -> dict[int, dict[str, float]]:
    """Unix minute -> prompts finished and output tokens written in it."""
    out: dict[int, dict[str, float]] = {}
    raw: dict[bytes, bytes] = ledger.r.hgetall(keys.job_part(job, "minutes"))  # type: ignore[assignment]
    for k, v in raw.items():
        minute, _, kind = k.decode().partition("|")
        slot = out.setdefault(int(minute), {"prompts": 0.0, "tokens": 0.0})
        slot["tokens" if kind == "tokens" else "prompts"] += float(v)
    return out


def _times(ledger: Ledger, job: str, created_at: float) -> dict[str, float]:
    """When the job started running (enqueue finished) and when its last batch was written."""
    started, last_write = ledger.r.hmget(keys.job(job), "started_at", "last_write_at")
    return {"started": float(started or created_at), "last_write": float(last_write or 0.0)}


def _creating_reason(ledger: Ledger, manifest: JobManifest, state: str) -> str | None:
    """For a job still being created: who is creating it, or that its enqueue was interrupted."""
    if state != STATE_CREATING:
        return None
    stored = int(ledger.r.hget(keys.job(manifest.name), "inputs_stored") or 0)
    holder = creation_holder(ledger, manifest.name)
    progress = f"{stored:,} of {manifest.batches:,} batch inputs stored"
    if holder is not None:
        return f"enqueue running on {holder} ({progress})"
    return (f"enqueue was interrupted ({progress} at its last report); no batch runs until it "
            f"finishes: run the same enqueue command again")


def _clock(
    minutes: dict[int, dict[str, float]], times: dict[str, float], now: float, finished: bool
) -> dict[str, float]:
    """Elapsed seconds (from the job's start; a finished job's clock stops at its last write,
    so its overall rate stays put) and the last-5-minutes window with what it produced."""
    start = times["started"]
    end = times["last_write"] if finished and times["last_write"] else now
    elapsed = max(0.1, end - start)
    first = int((now - RATE_WINDOW_S) // 60)
    recent = [v for m, v in minutes.items() if m >= first]
    # The window covers whole minute buckets: from the start of the oldest one picked.
    window = max(1.0, min(now - first * 60.0, now - start))
    return {"elapsed": elapsed, "window": window,
            "prompts": sum(v["prompts"] for v in recent), "tokens": sum(v["tokens"] for v in recent)}


def _rates(clock: dict[str, float], finished: int, output_tokens: float) -> dict[str, float]:
    return {
        "prompts_per_s_5m": round(clock["prompts"] / clock["window"], 3),
        "prompts_per_s_all": round(finished / clock["elapsed"], 3),
        "output_tokens_per_s_5m": round(clock["tokens"] / clock["window"], 1),
        "output_tokens_per_s_all": round(output_tokens / clock["elapsed"], 1),
    }


def _eta(remaining: int, state: str, rate: dict[str, float]) -> int | None:
    """Seconds to go at the recent rate (overall if nothing finished lately); None if stalled."""
    if not remaining:
        return 0
    per_s = rate["prompts_per_s_5m"] or rate["prompts_per_s_all"]
    if state != STATE_RUNNING or per_s <= 0:
        return None
    return round(remaining / per_s)


def _tokens(stats: dict[str, float], done: int) -> dict[str, Any]:
    out_tokens = stats.get("output_tokens", 0.0)
    reasoning = stats.get("reasoning_tokens", 0.0)
    return {
        "input": int(stats.get("input_tokens", 0)),
        "output": int(out_tokens),
        "reasoning": int(reasoning),
        "avg_output": round(out_tokens / done, 1) if done else None,
        "reasoning_share": round(reasoning / out_tokens, 3) if out_tokens else None,
    }


def _prefixed(stats: dict[str, float], prefix: str) -> dict[str, int]:
    # A code can fall back to 0 (its prompts requeued and answered): nothing to show then.
    return {k.removeprefix(prefix): int(v) for k, v in sorted(stats.items())
            if k.startswith(prefix) and int(v)}


def _workers(ledger: Ledger, job: str) -> dict[str, dict[str, float]]:
    """This job's counters per worker: prompts_done, prompts_failed, output_tokens, batches_done."""
    out: dict[str, dict[str, float]] = {}
    raw: dict[bytes, bytes] = ledger.r.hgetall(keys.job_part(job, "workers"))  # type: ignore[assignment]
    for k, v in raw.items():
        worker, _, counter = k.decode().partition("|")
        out.setdefault(worker, {})[counter] = float(v)
    return out


def _worker_errors(entries: dict[str, dict[str, Any]], now: float) -> list[dict[str, Any]]:
    """Each registered worker's last error (what kept a batch from running there), newest
    first, with how long ago it happened."""
    out = []
    for name, entry in entries.items():
        error = entry.get("last_error")
        if not isinstance(error, dict) or now - float(error.get("at") or 0) > ERROR_SHOWN_FOR_S:
            continue
        out.append({"worker": name, "host": entry.get("host"), "job": error.get("job"),
                    "error": str(error.get("error")),
                    "age_s": round(now - float(error["at"]), 1)})
    return sorted(out, key=lambda e: e["age_s"])


def _stalled(
    manifest: JobManifest, entries: dict[str, dict[str, Any]], errors: list[dict[str, Any]],
    queued: int, running: int, times: dict[str, float], now: float,
) -> dict[str, Any] | None:
    """Why work waits and nothing moves, or None: no live worker consumes the job's queue
    (known at once), or no worker of its queue is busy and nothing ran or was written for
    STALLED_AFTER_S, with the last error a worker met (on this job first)."""
    if not queued or running:
        return None
    live = [e for e in entries.values() if e.get("state") != "lost"]
    # Workers older than the `queues` field do not say what they consume: then nobody knows.
    if all("queues" in e for e in live) and not any(manifest.queue in e["queues"] for e in live):
        consumers = sorted({q for e in live for q in e["queues"]})
        return {"reason": "no_consumer", "queue": manifest.queue, "live_queues": consumers,
                "idle_s": None, "last_error": None, "not_ready": []}
    # Workers of the job's queue busy with other work: the job waits its turn, it is not stuck.
    if any(e.get("in_flight") and manifest.queue in e.get("queues", [manifest.queue])
           for e in live):
        return None
    idle = now - max(times["started"], times["last_write"])
    mine = [e for e in errors if e["job"] == manifest.name]
    # An error met on this job since its last write explains the wait: say so sooner.
    explained = any(now - e["age_s"] > max(times["started"], times["last_write"]) for e in mine)
    if idle < (STALLED_EXPLAINED_AFTER_S if explained else STALLED_AFTER_S):
        return None
    mine = mine or errors
    return {"reason": "no_progress", "queue": manifest.queue, "live_queues": None,
            "idle_s": round(idle, 1), "last_error": mine[0] if mine else None,
            # Live workers whose gate is closed (server down): they take no batch meanwhile.
            "not_ready": sorted(n for n, e in entries.items()
                                if e.get("state") not in ("ready", "lost"))}


def _canary(ledger: Ledger, job: str, manifest: JobManifest) -> dict[str, Any]:
    thresholds = Thresholds(**manifest.canary) if manifest.canary else Thresholds()
    seen, end = ledger.r.hmget(keys.job(job), "canary_seen", "canary_end")
    return {"enabled": thresholds.enabled, "answers_seen": int(seen or 0),
            "min_completions": thresholds.min_completions,
            # A job smaller than min_completions is judged once, at its end (workers/quality.py).
            "judged_at_end": manifest.prompts < thresholds.min_completions,
            "end_verdict": orjson.loads(end) if end else None}


def _quality(ledger: Ledger, job: str) -> dict[str, Any] | None:
    """What the canary found when it paused the job (None if it never did)."""
    examples, seen, accepted = ledger.r.hmget(
        keys.job(job), "quality_examples", "quality_seen", "quality_accepted")
    if examples is None:
        return None
    return {"examples": orjson.loads(examples), "detected_after": int(seen or 0),
            "accepted": accepted is not None}

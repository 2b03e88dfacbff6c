"""A job's progress in one view: counts, rate, ETA, tokens, finish reasons, quality, GPUs.

`job_status` gathers the figures into one dict: the `status --json` form and what
`progress.json` holds (field names are stable; new ones may be added). With `live=True` it
also reads every registered server (producer/fleet.py) for the per-GPU table. `render` prints
the dict for people.

    status = job_status(ledger, "distill-v1", live=True)
    print(render(status))
"""

from __future__ import annotations

import time
from typing import Any

import orjson

from producer.enqueue import creation_holder
from producer.fleet import read_fleet, render_fleet
from workers import keys
from workers.canary import Thresholds
from workers.job import JobManifest, batch_sizes
from workers.ledger import STATE_CREATING, STATE_RUNNING, Ledger

RATE_WINDOW_S = 300
STATE_DONE = "done"


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
    in_flight = min(in_hand, _sent(ledger, now))
    waiting = remaining - checkpointed - in_hand
    times = _times(ledger, job, manifest.created_at)
    clock = _clock(_minutes(ledger, job), times, now, finished)
    rate = _rates(clock, answered, stats.get("output_tokens", 0.0))
    workers = _workers(ledger, job)
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
        "queued": waiting if state == STATE_RUNNING else 0,
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
        "fleet": read_fleet(ledger.r, workers, clock["elapsed"], now=now)
        if live else None,
        "updated_at": now,
    }


def _sent(ledger: Ledger, now: float) -> int:
    """Requests the live workers have at their servers right now (their registry entries)."""
    total = 0
    for raw in ledger.r.hvals(keys.WORKERS):
        entry = orjson.loads(raw)
        if now - float(entry.get("updated") or 0) < REGISTRY_FRESH_S:
            total += int(entry.get("in_flight") or 0)
    return total


def _in_hand(ledger: Ledger, manifest: JobManifest, running: dict[str, float]) -> int:
    """Prompts of running batches that have not reached the checkpoint yet (sent or waiting)."""
    with ledger.r.pipeline(transaction=False) as p:
        for batch in running:
            p.hlen(keys.checkpoint(manifest.name, batch))
        checkpointed = p.execute()
    plan = batch_sizes(manifest.prompts, manifest.batch_size, taper=manifest.taper)
    sizes = sum(_batch_len(plan, manifest.batch_size, b) for b in running)
    return max(0, sizes - sum(int(n) for n in checkpointed))


# A worker re-registers every 5 s; an entry older than this is a worker that is gone.
REGISTRY_FRESH_S = 30.0


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


def _canary(ledger: Ledger, job: str, manifest: JobManifest) -> dict[str, Any]:
    thresholds = Thresholds(**manifest.canary) if manifest.canary else Thresholds()
    seen = ledger.r.hget(keys.job(job), "canary_seen")
    return {"enabled": thresholds.enabled, "answers_seen": int(seen or 0),
            "min_completions": thresholds.min_completions}


def _quality(ledger: Ledger, job: str) -> dict[str, Any] | None:
    """What the canary found when it paused the job (None if it never did)."""
    examples, seen, accepted = ledger.r.hmget(
        keys.job(job), "quality_examples", "quality_seen", "quality_accepted")
    if examples is None:
        return None
    return {"examples": orjson.loads(examples), "detected_after": int(seen or 0),
            "accepted": accepted is not None}


def render(status: dict[str, Any]) -> str:
    """The status dict as a screenful of text."""
    s = status
    lines = [
        f"job {s['job']}  [{s['state']}]{'  ' + s['reason'] if s['reason'] else ''}  -> {s['output']}",
        *_render_progress(s),
        *_render_quality(s),
    ]
    if s["errors"]:
        lines.append("  errors    " + ", ".join(f"{k} {v:,}" for k, v in s["errors"].items()))
    lines.append(f"  written   {_bytes(s['bytes_written'])}")
    if s.get("fleet") is not None:
        lines += ["", *(render_fleet(s["fleet"]) if s["fleet"] else ["  no workers registered"])]
    elif s["workers"]:
        lines += ["", f"  {'worker':<28} {'done':>8} {'failed':>7} {'out tokens':>12} {'batches':>8}"]
        for name, w in sorted(s["workers"].items()):
            lines.append(
                f"  {name:<28} {int(w.get('prompts_done', 0)):>8,} {int(w.get('prompts_failed', 0)):>7,}"
                f" {int(w.get('output_tokens', 0)):>12,} {int(w.get('batches_done', 0)):>8,}")
    return "\n".join(lines)


def _render_progress(s: dict[str, Any]) -> list[str]:
    total = s["total"] or 1
    pct = 100.0 * (s["done"] + s["failed"]) / total
    r, t, b = s["rate"], s["tokens"], s["batches"]
    if s["eta_s"] is not None:
        eta = format_duration(s["eta_s"])
    else:
        eta = s["state"] if s["state"] != STATE_RUNNING else "unknown"
    waiting = f"queued {s['queued']:,}" + (f"  held {s['held']:,} ({s['state']})" if s["held"] else "")
    return [
        (f"  prompts   {s['done'] + s['failed']:,}/{s['total']:,} ({pct:.1f}%)  done {s['done']:,}"
         f"  failed {s['failed']:,}  checkpointed {s['checkpointed']:,}"
         f"  in flight {s['in_flight']:,}  in hand {s['in_hand'] - s['in_flight']:,}  {waiting}"),
        f"  batches   {b['done']:,}/{b['total']:,} done, {b['running']:,} running, {b['queued']:,} queued",
        (f"  rate      last 5 min {r['prompts_per_s_5m']:,.2f} prompts/s,"
         f" {r['output_tokens_per_s_5m']:,.0f} out tok/s;  overall {r['prompts_per_s_all']:,.2f}"
         f" prompts/s, {r['output_tokens_per_s_all']:,.0f} out tok/s"),
        f"  time      elapsed {format_duration(s['elapsed_s'])}   ETA {eta}",
        (f"  tokens    in {t['input']:,}  out {t['output']:,}  avg out {t['avg_output'] or 0:,.0f}"
         f"  reasoning share {100 * (t['reasoning_share'] or 0):.0f}%"),
        "  finish    " + (", ".join(f"{k} {v:,}" for k, v in s["finish_reasons"].items()) or "-")
        + f"   empty content {s['empty_content']:,}",
    ]


def _render_quality(s: dict[str, Any]) -> list[str]:
    q, c = s.get("quality"), s.get("canary")
    if not q:
        if c and c["enabled"]:
            return [(f"  canary    watching: {c['answers_seen']:,} answers seen"
                     f" (judges from {c['min_completions']:,})")]
        return ["  canary    off"] if c else []
    lines = [(f"  quality   canary fired after {q['detected_after']:,} answers"
              f"{' (accepted by user: going on)' if q['accepted'] else ''}; examples:")]
    for ex in q["examples"]:
        lines.append(f"            {ex['id']}: {ex['content']!r} ({ex['output_tokens']} tokens"
                     f"{', cut at max_tokens' if ex.get('length') else ''})")
    if not q["accepted"] and s["state"] == "paused":
        lines.append(f"            go on anyway: python -m producer resume {s['job']} --accept-quality")
    return lines


def _bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000:
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1000
    return f"{n:,.1f} TB"


def format_duration(seconds: float) -> str:
    """`1h05m` or `4m09s`."""
    seconds = int(seconds)
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"

"""A job's progress in one view: counts, rate, ETA, tokens, finish reasons, workers.

`job_status` gathers the figures from the ledger into one dict (the `--json` form, and what
`progress.json` holds); `render` prints it for people.
"""

from __future__ import annotations

import time
from typing import Any

import orjson

from workers import keys
from workers.ledger import Ledger

RATE_WINDOW_S = 300


def job_status(ledger: Ledger, job: str, now: float | None = None) -> dict[str, Any]:
    now = time.time() if now is None else now
    manifest = ledger.load_job(job)
    state, reason = ledger.job_state(job)
    stats = ledger.stats(job)
    done = int(stats.get("prompts_done", 0))
    failed = int(stats.get("prompts_failed", 0))
    running = ledger.running_batches(job)
    queued = ledger.queued_batches(job)
    in_flight = sum(_batch_len(manifest.prompts, manifest.batch_size, b) for b in running) - sum(
        int(ledger.r.hlen(keys.checkpoint(job, b))) for b in running
    )
    remaining = max(0, manifest.prompts - done - failed)
    minutes = _minutes(ledger, job)
    recent = _window(minutes, now, RATE_WINDOW_S)
    started = min((m for m in minutes), default=None)
    elapsed = max(1.0, now - (started * 60 if started is not None else manifest.created_at))
    window = min(float(RATE_WINDOW_S), elapsed)
    rate_5m = recent["prompts"] / window
    rate_all = (done + failed) / elapsed
    rate = rate_5m or rate_all
    finished_batches = len(ledger.done_batches(job))
    total_batches = manifest.batches + int(ledger.r.scard(keys.job_part(job, "extra")))
    out_tokens = stats.get("output_tokens", 0.0)
    return {
        "job": job,
        "state": "done" if finished_batches >= total_batches and state == "running" else state,
        "reason": reason or None,
        "output": manifest.output,
        "total": manifest.prompts,
        "done": done,
        "failed": failed,
        "in_flight": max(0, in_flight),
        "queued": max(0, manifest.prompts - done - failed - max(0, in_flight)) if queued else 0,
        "batches": {"total": total_batches, "done": finished_batches,
                    "running": len(running), "queued": len(queued)},
        "rate": {
            "prompts_per_s_5m": round(rate_5m, 3),
            "prompts_per_s_all": round(rate_all, 3),
            "output_tokens_per_s_5m": round(recent["tokens"] / window, 1),
            "output_tokens_per_s_all": round(out_tokens / elapsed, 1),
        },
        "eta_s": round(remaining / rate) if rate > 0 and remaining else (0 if not remaining else None),
        "tokens": {
            "input": int(stats.get("input_tokens", 0)),
            "output": int(out_tokens),
            "reasoning": int(stats.get("reasoning_tokens", 0)),
            "avg_output": round(out_tokens / done, 1) if done else None,
            "reasoning_share": round(stats.get("reasoning_tokens", 0) / out_tokens, 3)
            if out_tokens else None,
        },
        "finish_reasons": {
            k.removeprefix("finish_"): int(v) for k, v in sorted(stats.items())
            if k.startswith("finish_")
        },
        "errors": {
            k.removeprefix("error_"): int(v) for k, v in sorted(stats.items())
            if k.startswith("error_")
        },
        "empty_content": int(stats.get("empty_content", 0)),
        "bytes_written": int(stats.get("bytes_written", 0)),
        "workers": _workers(ledger, job),
        "quality": _quality(ledger, job),
        "updated_at": now,
    }


def _quality(ledger: Ledger, job: str) -> dict[str, Any] | None:
    examples, seen, accepted = ledger.r.hmget(
        keys.job(job), "quality_examples", "quality_seen", "quality_accepted")
    if examples is None:
        return None
    return {"examples": orjson.loads(examples), "detected_after": int(seen or 0),
            "accepted": accepted is not None}


def _batch_len(prompts: int, size: int, batch: str) -> int:
    index = int(batch.lstrip("b").split("-")[-1] or 0)
    return max(0, min(size, prompts - (index - 1) * size))


def _minutes(ledger: Ledger, job: str) -> dict[int, dict[str, float]]:
    out: dict[int, dict[str, float]] = {}
    for k, v in ledger.r.hgetall(keys.job_part(job, "minutes")).items():  # type: ignore[union-attr]
        name = k.decode()
        minute, _, kind = name.partition("|")
        slot = out.setdefault(int(minute), {"prompts": 0.0, "tokens": 0.0})
        slot["tokens" if kind == "tokens" else "prompts"] += float(v)
    return out


def _window(minutes: dict[int, dict[str, float]], now: float, span: float) -> dict[str, float]:
    first = int((now - span) // 60)
    picked = [v for m, v in minutes.items() if m >= first]
    return {"prompts": sum(v["prompts"] for v in picked), "tokens": sum(v["tokens"] for v in picked)}


def _workers(ledger: Ledger, job: str) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for k, v in ledger.r.hgetall(keys.job_part(job, "workers")).items():  # type: ignore[union-attr]
        worker, _, counter = k.decode().partition("|")
        out.setdefault(worker, {})[counter] = float(v)
    return out


def render(status: dict[str, Any]) -> str:
    s = status
    total = s["total"] or 1
    pct = 100.0 * (s["done"] + s["failed"]) / total
    eta = _duration(s["eta_s"]) if s["eta_s"] is not None else "unknown"
    r, t = s["rate"], s["tokens"]
    lines = [
        f"job {s['job']}  [{s['state']}]{'  ' + s['reason'] if s['reason'] else ''}  -> {s['output']}",
        f"  prompts   {s['done'] + s['failed']:,}/{s['total']:,} ({pct:.1f}%)  done {s['done']:,}"
        f"  failed {s['failed']:,}  in flight {s['in_flight']:,}  queued {s['queued']:,}",
        f"  batches   {s['batches']['done']}/{s['batches']['total']} done, "
        f"{s['batches']['running']} running, {s['batches']['queued']} queued",
        f"  rate      {r['prompts_per_s_5m']:.2f} prompts/s (5 min), {r['prompts_per_s_all']:.2f} overall;"
        f"  {r['output_tokens_per_s_5m']:,.0f} output tok/s (5 min)   ETA {eta}",
        f"  tokens    in {t['input']:,}  out {t['output']:,}  avg out {t['avg_output'] or 0:,.0f}"
        f"  reasoning share {100 * (t['reasoning_share'] or 0):.0f}%",
        "  finish    " + (", ".join(f"{k} {v:,}" for k, v in s["finish_reasons"].items()) or "-")
        + f"   empty content {s['empty_content']:,}",
    ]
    if s.get("quality"):
        q = s["quality"]
        lines.append(f"  quality   canary fired after {q['detected_after']} answers"
                     f"{' (accepted by user)' if q['accepted'] else ''}; examples:")
        for ex in q["examples"]:
            lines.append(f"            {ex['id']}: {ex['content']!r} ({ex['output_tokens']} tokens)")
    if s["errors"]:
        lines.append("  errors    " + ", ".join(f"{k} {v:,}" for k, v in s["errors"].items()))
    lines.append(f"  written   {s['bytes_written'] / 1e6:,.1f} MB")
    if s["workers"]:
        lines.append(f"  {'worker':<28} {'done':>8} {'failed':>7} {'out tokens':>12} {'batches':>8}")
        for name, w in sorted(s["workers"].items()):
            lines.append(
                f"  {name:<28} {int(w.get('prompts_done', 0)):>8,} {int(w.get('prompts_failed', 0)):>7,}"
                f" {int(w.get('output_tokens', 0)):>12,} {int(w.get('batches_done', 0)):>8,}"
            )
    return "\n".join(lines)


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"

"""Publishing batches to the broker, always after the ledger says they are queued, and finding
which batches the broker holds (waiting in a queue list or unacked by a worker)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterable
from typing import Any

import orjson
from celery import Celery

from fleetgen import keys
from fleetgen.ledger import Ledger


def task_id(job: str, batch: str) -> str:
    """Task ids carry job and batch, so a broker scan can tell which batches are waiting."""
    return f"{job}:{batch}:{uuid.uuid4().hex[:8]}"


def parse_task_id(value: str) -> tuple[str, str] | None:
    parts = value.rsplit(":", 2)
    return (parts[0], parts[1]) if len(parts) == 3 else None


def dispatch(
    app: Celery, ledger: Ledger, job: str, batches: Iterable[str], queue: str,
    *, redrive: bool = False,
) -> int:
    """Queue batches: ledger first (so a crash in between is seen by the reconciler), then broker.

    `redrive` marks work that was already started once (its worker died, its lease was lost, it
    was handed back): it goes out at the broker's top priority, so every worker takes it before
    any fresh batch instead of after the whole queue.
    """
    pending = list(batches)
    priority = keys.REDRIVE_PRIORITY if redrive else keys.FRESH_PRIORITY
    ledger.mark_queued(job, pending)
    with app.producer_or_acquire() as producer:
        for batch in pending:
            app.send_task(
                keys.TASK_RUN_BATCH,
                args=[job, batch],
                queue=queue,
                task_id=task_id(job, batch),
                producer=producer,
                priority=priority,
                argsrepr=f"{job} {batch}",
            )
    return len(pending)


def broker_batches(r: Any, *, grace_s: float) -> set[tuple[str, str]]:
    """(job, batch) of every message waiting in a queue list or held unacked by a worker.

    An unacked message delivered more than `grace_s` ago whose batch has no lease belongs to a
    worker that died between taking it and leasing it; it does not count as waiting.
    Only kombu's JSON envelope is read (`headers.id`, the task id), never the body, so the
    task serializer does not matter; the layout does (see the kombu pin in pyproject.toml).
    """
    found: set[tuple[str, str]] = set()
    for name in r.scan_iter(match="*", count=1000, _type="list"):
        for raw in r.lrange(name, 0, -1):
            _collect(found, raw)
    now = time.time()
    recent = {tag for tag, score in r.zrange("unacked_index", 0, -1, withscores=True)
              if now - score < grace_s}
    for tag, raw in r.hgetall("unacked").items():
        if tag not in recent:
            continue
        try:
            _collect(found, orjson.dumps(orjson.loads(raw)[0]))
        except (orjson.JSONDecodeError, IndexError, TypeError):
            continue
    return found


def _collect(found: set[tuple[str, str]], raw: Any) -> None:
    try:
        message = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return
    task_id = (message.get("headers") or {}).get("id") if isinstance(message, dict) else None
    parsed = parse_task_id(task_id) if isinstance(task_id, str) else None
    if parsed:
        found.add(parsed)

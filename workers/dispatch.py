"""Publishing batches to the broker, always after the ledger says they are queued."""

from __future__ import annotations

import uuid
from collections.abc import Iterable

from celery import Celery

from workers import keys
from workers.ledger import Ledger


def task_id(job: str, batch: str) -> str:
    """Task ids carry job and batch, so a broker scan can tell which batches are waiting."""
    return f"{job}:{batch}:{uuid.uuid4().hex[:8]}"


def parse_task_id(value: str) -> tuple[str, str] | None:
    parts = value.rsplit(":", 2)
    return (parts[0], parts[1]) if len(parts) == 3 else None


def dispatch(app: Celery, ledger: Ledger, job: str, batches: Iterable[str], queue: str) -> int:
    """Queue batches: ledger first (so a crash in between is seen by the reconciler), then broker."""
    pending = list(batches)
    ledger.mark_queued(job, pending)
    with app.producer_or_acquire() as producer:
        for batch in pending:
            app.send_task(
                keys.TASK_RUN_BATCH,
                args=[job, batch],
                queue=queue,
                task_id=task_id(job, batch),
                producer=producer,
                argsrepr=f"{job} {batch}",
            )
    return len(pending)

"""Publishing batches to the broker, always after the ledger says they are queued."""

from __future__ import annotations

import uuid
from collections.abc import Iterable

from celery import Celery

from fleetgen import keys
from fleetgen.ledger import Ledger


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
    ledger.batches.mark_queued_and_settle(job, pending)
    return publish(app, job, pending, queue, redrive=redrive)


def publish(app: Celery, job: str, batches: Iterable[str], queue: str, *,
            redrive: bool = False) -> int:
    """Send batches' messages to the broker alone, each under a new task id. `dispatch` is the
    way in: its ledger entry first. Alone only where the job's ledger cannot be written (its
    ledger shard out of reach) and already holds the batch."""
    priority = keys.REDRIVE_PRIORITY if redrive else keys.FRESH_PRIORITY
    sent = 0
    with app.producer_or_acquire() as producer:
        for batch in batches:
            app.send_task(
                keys.TASK_RUN_BATCH,
                args=[job, batch],
                queue=queue,
                task_id=keys.task_id(job, batch, uuid.uuid4().hex[:8]),
                producer=producer,
                priority=priority,
                argsrepr=f"{job} {batch}",
            )
            sent += 1
    return sent

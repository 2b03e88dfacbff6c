"""The Celery task and the worker lifecycle hooks."""

from __future__ import annotations

import logging
from typing import Any

from celery import Task
from celery.signals import celeryd_after_setup, worker_ready, worker_shutdown, worker_shutting_down

from workers import keys, metrics
from workers.app import app, settings
from workers.dispatch import dispatch
from workers.errors import JobNotRunningError, ServerDownError, SinkError, WorkerStoppingError
from workers.gate import ServerGate
from workers.reconciler import Reconciler
from workers.runtime import runtime

log = logging.getLogger(__name__)
# Celery's own "ready." is INFO and a worker's default level is WARNING: this logger says
# once, at any level, that the worker consumes, from where and for which server.
ready_log = logging.getLogger("workers.ready")
ready_log.setLevel(logging.INFO)
_reconciler: Reconciler | None = None
app.steps["consumer"].add(ServerGate)


@celeryd_after_setup.connect
def _setup_worker(sender: str, instance: Any, **_: Any) -> None:
    queues = instance.app.amqp.queues
    own = [name for name in queues.consume_from] if queues.consume_from else [keys.SHARED_QUEUE]
    if keys.SHARED_QUEUE not in own:
        queues.select_add(keys.SHARED_QUEUE)
    runtime.configure(settings, sender, own)
    log.info("worker %s: queues %s + %s, server %s", sender, own, keys.SHARED_QUEUE, runtime.server_url)


@worker_ready.connect
def _start(sender: Any = None, **_: Any) -> None:
    global _reconciler
    # One line per request at INFO would drown the lifecycle lines.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    runtime.runner()
    port = metrics.exporter_port(settings.metrics_port, runtime.queues)
    if port is not None:
        try:
            bound = metrics.start_exporter(port, settings.metrics_host)
            log.info("worker %s: metrics on http://%s:%d/metrics", runtime.worker,
                     settings.metrics_host, bound)
        except metrics.ExporterError as exc:
            log.error("worker %s: no metrics (%s)", runtime.worker, exc)
    _reconciler = Reconciler(app, settings, runtime.worker)
    _reconciler.start()
    controller = getattr(sender, "controller", None)
    ready_log.info("worker %s ready: queues %s, server %s, concurrency %s", runtime.worker,
                   ",".join(runtime.queues), runtime.server_url,
                   getattr(controller, "concurrency", app.conf.worker_concurrency))


@worker_shutting_down.connect
def _drain(**_: Any) -> None:
    # Runs inside the SIGTERM handler: set a flag, nothing else (no logging, no I/O).
    runtime.drain()


@worker_shutdown.connect
def _shutdown(**_: Any) -> None:
    if _reconciler is not None:
        _reconciler.stop()
    runtime.shutdown()
    metrics.stop_exporter()


@app.task(name=keys.TASK_RUN_BATCH, bind=True, acks_late=True)
def run_batch(self: Task, job: str, batch: str) -> dict[str, Any]:
    """Generate one batch of a job; acked only after its output is written (or it is a no-op)."""
    try:
        outcome = runtime.runner().run(job, batch)
    except (ServerDownError, WorkerStoppingError, SinkError) as exc:
        # The server or the sink stayed down, or this worker is stopping: hand the batch back
        # without spending its attempt; finished prompts stay checkpointed, so whoever takes it
        # next resumes where this one stopped.
        queue = (self.request.delivery_info or {}).get("routing_key") or keys.SHARED_QUEUE
        log.warning("batch %s/%s: %s; requeued to %s", job, batch, exc, queue)
        assert runtime.ledger is not None
        dispatch(app, runtime.ledger, job, [batch], queue, redrive=True)
        return {"status": "requeued", "batch": batch, "reason": str(exc)}
    if outcome.status.startswith("skipped-"):
        # Raised so Flower lists the dropped delivery with the job's reason (e.g. the canary's).
        assert runtime.ledger is not None
        state, reason = runtime.ledger.job_state(job)
        raise JobNotRunningError(f"job {job} is {state}: {reason or 'no reason given'}; "
                                 f"batch {batch} left for `python -m producer resume {job}`")
    return outcome.as_dict()

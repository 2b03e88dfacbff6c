"""The Celery task and the worker lifecycle hooks."""

from __future__ import annotations

import contextlib
import logging
import signal
import time
from typing import Any, NotRequired, TypedDict

from celery import Task
from celery.signals import celeryd_after_setup, worker_ready, worker_shutdown, worker_shutting_down

from fleetgen import keys
from fleetgen.dispatch import dispatch, publish
from fleetgen.errors import (
    NotHereError,
    PreflightError,
    ServerDownError,
    ServerSickError,
    SinkError,
    SinkUnusableError,
    WorkerStoppingError,
)
from fleetgen.ledger import UnknownShardError
from fleetgen.retry import REDIS_ERRORS
from workers import metrics, preflight
from workers.app import app, settings
from workers.gate import ServerGate
from workers.reconciler import Reconciler
from workers.runtime import runtime, server_url, tune_gc

log = logging.getLogger(__name__)
# How long a worker holds a batch of a job blocked here before acking it and taking the next.
HANDBACK_PAUSE_S = 2.0
READY_LINE_WAIT_S = 3.0
# Celery's own "ready." is INFO and a worker's default level is WARNING: this logger says
# once, at any level, that the worker consumes, from where and for which server, once that
# server is usable (until then the worker says why it waits: workers/discovery.py).
ready_log = logging.getLogger("workers.ready")
ready_log.setLevel(logging.INFO)
_reconciler: Reconciler | None = None
app.steps["consumer"].add(ServerGate)


class TaskResult(TypedDict):
    """What `run_batch` returns, as Celery stores it (JSON) and Flower shows it: the batch's
    outcome (workers/batch.py `Outcome`), or why it was requeued or left for `resume`; `server`
    is how its server treated this worker's requests lately (fleetgen/fleet.py `ServerHealth`)."""

    status: str
    batch: str
    job: NotRequired[str]
    reason: NotRequired[str]
    done: NotRequired[int]
    failed: NotRequired[int]
    resumed: NotRequired[int]
    attempt: NotRequired[int]
    server: NotRequired[dict[str, object]]


@celeryd_after_setup.connect
def _setup_worker(sender: str, instance: Any, **_: Any) -> None:
    queues = instance.app.amqp.queues
    own = [name for name in queues.consume_from] if queues.consume_from else [keys.SHARED_QUEUE]
    if keys.SHARED_QUEUE not in own:
        queues.select_add(keys.SHARED_QUEUE)
    try:
        server = preflight.check_start(settings, sender, lambda: server_url(settings, own))
    except PreflightError as exc:
        # Raised here, Celery would log it and run on without a server (a signal handler's
        # errors are only logged); SystemExit ends the worker before it consumes anything.
        preflight.refuse(str(exc))
    runtime.configure(settings, sender, own, server)
    log.info("worker %s: queues %s + %s, server %s", sender, own, keys.SHARED_QUEUE, runtime.server_url)


@worker_ready.connect
def _start(sender: Any = None, **_: Any) -> None:
    global _reconciler
    # One line per request at INFO would drown the lifecycle lines.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    runner = runtime.runner()
    backend = runner.backend
    backend.registration.publish()
    with contextlib.suppress(ValueError):  # not the main thread: no handler (tests)
        signal.signal(keys.RESTART_SIGNAL, _server_restarting)
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
    # Last: what the worker built so far lives as long as it does (runtime.tune_gc).
    tune_gc()
    with contextlib.suppress(ServerDownError):
        # A moment for the server's first answer, so the line says what the worker makes of it.
        runner.loop.run(backend.discovery.connected(READY_LINE_WAIT_S))

    def ready() -> None:
        ready_log.info("worker %s ready: queues %s, server %s, requests in flight up to %d (%s)",
                       runtime.worker, ",".join(runtime.queues), runtime.server_url,
                       backend.in_flight.limit, backend.in_flight.reason)

    # Now, or from the loop once a server fleetgen can use answers.
    runner.loop.run(backend.discovery.when_usable(ready))


@worker_shutting_down.connect
def _drain(**_: Any) -> None:
    # Runs inside the SIGTERM handler: set a flag, nothing else (no logging, no I/O).
    runtime.drain()


def _server_restarting(signum: int, frame: object) -> None:
    # RESTART_SIGNAL from the node supervisor: only schedules the change (runtime.py).
    runtime.server_restarting()


@worker_shutdown.connect
def _shutdown(**_: Any) -> None:
    if _reconciler is not None:
        _reconciler.stop()
    runtime.shutdown()
    metrics.stop_exporter()


# Jobs whose ledger shard this worker has said it cannot reach or was not given: one line each.
_off_shard_said: set[str] = set()


def _hand_back_off_shard(task: Task, job: str, batch: str, shard: str,
                         exc: Exception) -> TaskResult:
    """Hand back a batch whose job's ledger shard is out of reach (or not one this worker was
    given), no attempt spent: its ledger, on that shard, cannot be written, so the batch goes to
    the broker alone. The shard's ledger still has it queued, or leased under a lease that
    lapses; when the shard is back, whoever takes the message runs it, and the reconciler's
    rules cover a copy sent twice."""
    queue = (task.request.delivery_info or {}).get("routing_key") or keys.SHARED_QUEUE
    unknown = isinstance(exc, UnknownShardError)
    if unknown:
        queue = keys.SHARED_QUEUE  # another worker may have been given the shard
    publish(app, job, [batch], queue)
    if job not in _off_shard_said:
        _off_shard_said.add(job)
        if unknown:
            log.warning("job %s: %s; its batches are handed back", job, exc)
        else:
            log.warning("job %s: its ledger shard %s is out of reach (%s); its batches are "
                        "handed back until it is back", job, shard, exc)
    time.sleep(HANDBACK_PAUSE_S)  # not straight back to this worker
    return TaskResult(status="requeued", job=job, batch=batch,
                      reason=f"ledger shard {shard} out of reach" if not unknown else str(exc))


@app.task(name=keys.TASK_RUN_BATCH, bind=True, acks_late=True)
def run_batch(self: Task, job: str, batch: str) -> TaskResult:
    """Generate one batch of a job; acked only after its output is written (or it is a no-op)."""
    runner = runtime.runner()
    backend = runner.backend
    try:
        outcome = runner.run(job, batch)
    except (ServerDownError, WorkerStoppingError, SinkError, NotHereError) as exc:
        # The server or the sink stayed down, or this worker is stopping, or it cannot run the
        # job's batches (its rollout, its kind of request): hand the batch back, no attempt
        # spent (none was taken, or its release
        # refunded it: batch.ending); finished prompts stay checkpointed, so whoever takes it
        # next resumes where this one stopped.
        queue = (self.request.delivery_info or {}).get("routing_key") or keys.SHARED_QUEUE
        if isinstance(exc, ServerSickError | NotHereError):
            # This server is out of rotation, or this worker cannot run the job's batches:
            # the batch goes where every worker takes it.
            queue = keys.SHARED_QUEUE
        assert runtime.ledger is not None
        dispatch(app, runtime.ledger, job, [batch], queue, redrive=True)
        if not isinstance(exc, WorkerStoppingError):
            backend.registration.note_error(job, str(exc))
        if isinstance(exc, SinkUnusableError | ServerSickError | NotHereError):
            # The job or the server is blocked here, not the batch: other workers take it. The
            # pause keeps this worker (its gate sees a batch loading, then closes for a server
            # out of rotation) from taking it straight back.
            log.info("batch %s/%s: handed back to %s (%s)", job, batch, queue, exc)
            time.sleep(HANDBACK_PAUSE_S)
        else:
            log.warning("batch %s/%s: %s; requeued to %s", job, batch, exc, queue)
        return TaskResult(status="requeued", batch=batch, reason=str(exc),
                          server=backend.checks.report().as_task_result())
    except (UnknownShardError, *REDIS_ERRORS) as exc:
        assert runtime.ledger is not None
        shard = (exc.shard if isinstance(exc, UnknownShardError)
                 else runtime.ledger.shards.out_of_reach(job))
        if shard is None:  # REDIS_URL's server: the broker is out of reach with it
            backend.registration.note_error(job, f"{type(exc).__name__}: {exc}")
            raise
        return _hand_back_off_shard(self, job, batch, shard, exc)
    except Exception as exc:
        backend.registration.note_error(job, f"{type(exc).__name__}: {exc}")
        raise
    if outcome.status.startswith("skipped-"):
        # A paused or cancelled job's delivery is dropped on purpose: the task ends normally
        # (Flower lists it as succeeded, with this result), not as a failure.
        assert runtime.ledger is not None
        state, reason = runtime.ledger.jobs.state(job)
        return TaskResult(
            status=state, job=job, batch=batch,
            reason=f"job {job} is {state}: {reason or 'no reason given'}; batch {batch} "
                   f"left for `python -m producer resume {job}`")
    return TaskResult(status=outcome.status, batch=outcome.batch, done=outcome.done,
                      failed=outcome.failed, resumed=outcome.resumed, attempt=outcome.attempt,
                      server=backend.checks.report().as_task_result())

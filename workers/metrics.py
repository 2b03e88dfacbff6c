"""Prometheus metrics of one worker process, served on its own `/metrics` port.

Each GPU worker is one process (Celery threads pool), so each process serves its own
registry on a port derived from its GPU: queue gpuN -> 20000+N (keys.METRICS_BASE_PORT), and a
server over several GPUs (gpuN-M) -> 20000+N, its lead GPU (`FLEETGEN_METRICS_PORT` overrides,
0 turns it off), on 127.0.0.1 unless `FLEETGEN_METRICS_HOST` says otherwise.
That is simpler and more honest than prometheus_client's multiprocess mode (one shared
`PROMETHEUS_MULTIPROC_DIR` aggregated by one endpoint): no mmap files to wipe at start, gauges
keep their plain meaning, `process_*` metrics work, and a dead worker shows up as its own
target going down (`up == 0`) rather than as numbers that merely stop moving.

The batch runner calls the functions below; all are cheap (a dict lookup and a locked add)
and thread-safe:

    port = start_exporter(20000)
    request_started(job, worker, server)
    ...
    request_ended(job, worker, server)
    prompt_finished(job, worker, server, ok=True, finish_reason="stop", error_code=None,
                    input_tokens=812, output_tokens=2315, reasoning_tokens=1900,
                    latency_s=41.2, queue_wait_s=0.03)

Every family is named `fleetgen_*` and labelled `job`, `worker` (the Celery node name, as
in Flower) and `server` (the SGLang URL); docs/reference/metrics.md lists them and
docs/guides/prometheus.md#scraping has a scrape config.
A finished job's series are removed (`forget_job`, from the reconciler's round), so a worker
that runs thousands of jobs serves the active ones' series, not every job's it ever ran.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Iterable
from typing import NamedTuple
from wsgiref.simple_server import WSGIServer

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    disable_created_metrics,
)
from prometheus_client.exposition import start_http_server

from fleetgen import keys
from fleetgen.errors import FleetgenError

log = logging.getLogger(__name__)

DEFAULT_HOST = "127.0.0.1"

# A cached short answer takes ~0.1 s; a 30k-token thinking answer under load can take hours.
LATENCY_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300, 600, 1200, 1800,
                   3600, 7200, 14400)
# Near zero while the server has free slots; minutes to an hour when a batch's prompts queue
# behind a full server (the limiter admits effective max_running_requests + margin).
QUEUE_WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, 120, 300, 600,
                      1800, 3600)
# Batches are sized for 1-30 min; the tails show stragglers and resumed batches.
BATCH_BUCKETS = (1, 5, 10, 30, 60, 120, 300, 600, 900, 1200, 1800, 2700, 3600, 7200, 14400)

LABELS = ("job", "worker", "server")
DONE_LABELS = (*LABELS, "finish_reason")
FAILED_LABELS = (*LABELS, "reason")
BATCH_LABELS = (*LABELS, "status")

REGISTRY = CollectorRegistry(auto_describe=True)
ProcessCollector(registry=REGISTRY)

PROMPTS_DONE = Counter(
    "fleetgen_prompts_done", "Prompts answered, by the server's finish_reason.",
    DONE_LABELS, registry=REGISTRY)
PROMPTS_FAILED = Counter(
    "fleetgen_prompts_failed", "Prompts given up on, by error code (records.error_code).",
    FAILED_LABELS, registry=REGISTRY)
INPUT_TOKENS = Counter(
    "fleetgen_input_tokens", "Prompt tokens of answered prompts (usage.prompt_tokens).",
    LABELS, registry=REGISTRY)
OUTPUT_TOKENS = Counter(
    "fleetgen_output_tokens", "Completion tokens of answered prompts, reasoning included.",
    LABELS, registry=REGISTRY)
REASONING_TOKENS = Counter(
    "fleetgen_reasoning_tokens", "The reasoning part of fleetgen_output_tokens.",
    LABELS, registry=REGISTRY)
REQUEST_LATENCY = Histogram(
    "fleetgen_request_latency_seconds", "Time SGLang took to answer a prompt (answered only).",
    LABELS, buckets=LATENCY_BUCKETS, registry=REGISTRY)
QUEUE_WAIT = Histogram(
    "fleetgen_request_queue_wait_seconds",
    "Time a prompt waited in the worker for an in-flight slot before its request was sent.",
    LABELS, buckets=QUEUE_WAIT_BUCKETS, registry=REGISTRY)
IN_FLIGHT = Gauge(
    "fleetgen_requests_in_flight", "Requests sent to SGLang and not answered yet.",
    LABELS, registry=REGISTRY)
BATCH_DURATION = Histogram(
    "fleetgen_batch_duration_seconds", "Wall time of one batch delivery, by how it ended.",
    BATCH_LABELS, buckets=BATCH_BUCKETS, registry=REGISTRY)
SERVER_CAPACITY = Gauge(
    "fleetgen_server_max_running_requests",
    "Requests the server runs at once, as it reports it (effective max_running_requests).",
    ("worker", "server"), registry=REGISTRY)
IN_FLIGHT_LIMIT = Gauge(
    "fleetgen_worker_max_in_flight_requests",
    "The worker's cap on requests in flight: server capacity plus the queue margin, under "
    "the overload ceiling while the server refuses requests for being full.",
    ("worker", "server"), registry=REGISTRY)
SERVER_REQUESTS = Counter(
    "fleetgen_server_requests_not_answered",
    "Requests the server did not answer, by cause: overloaded (429/503: sent again later, no "
    "attempt spent), failed (5xx, reset, abort, timeout: the server's fault), refused (4xx: "
    "the prompt's or the job's), and the HTTP status (empty without one).",
    ("worker", "server", "cause", "status"), registry=REGISTRY)
IN_ROTATION = Gauge(
    "fleetgen_server_in_rotation",
    "1 while the worker sends its server requests, 0 while it is out of rotation (failing "
    "what it is sent) and probed.", ("worker", "server"), registry=REGISTRY)
SERVER_HANGS = Counter(
    "fleetgen_server_hangs_total",
    "Times the worker found its server hung: requests in flight, nothing back for many times "
    "the usual gap between replies, and a probe unanswered; its requests were abandoned and "
    "handed back.", ("worker", "server"), registry=REGISTRY)
ROLLOUTS_RUNNING = Gauge(
    "fleetgen_rollouts_running",
    "Rollouts (programs per prompt) running now: at the server, waiting for a slot, or in "
    "their own code and tools.", LABELS, registry=REGISTRY)
ROLLOUT_CALLS = Counter(
    "fleetgen_rollout_calls_total",
    "Calls rollouts made, by where the answer came from: the server, or the journal (a "
    "rollout run again after a crash or a hand-back gets its recorded calls back).",
    (*LABELS, "source"), registry=REGISTRY)
# The families labelled by job, with their label names: what `forget_job` removes.
_BY_JOB: tuple[tuple[Counter | Gauge | Histogram, tuple[str, ...]], ...] = (
    (PROMPTS_DONE, DONE_LABELS), (PROMPTS_FAILED, FAILED_LABELS), (INPUT_TOKENS, LABELS),
    (OUTPUT_TOKENS, LABELS), (REASONING_TOKENS, LABELS), (REQUEST_LATENCY, LABELS),
    (QUEUE_WAIT, LABELS), (IN_FLIGHT, LABELS), (BATCH_DURATION, BATCH_LABELS),
    (ROLLOUTS_RUNNING, LABELS), (ROLLOUT_CALLS, (*LABELS, "source")))


class ExporterError(FleetgenError):
    """The `/metrics` port could not be bound (taken, or not an address of this host)."""


class _Exporter:
    """The one HTTP server of this process; a lock makes start/stop safe from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._server: WSGIServer | None = None
        self._thread: threading.Thread | None = None

    def start(self, port: int, host: str) -> int:
        with self._lock:
            if self._server is not None:
                bound = int(self._server.server_port)
                if port not in (0, bound):
                    log.warning("metrics: already serving on port %d; ignoring port %d", bound, port)
                return bound
            # Prometheus stores each `_created` sample as a series of its own: half the series
            # for a timestamp nobody queries. (Process-wide, hence here: only exporters do it.)
            disable_created_metrics()  # type: ignore[no-untyped-call]
            try:
                self._server, self._thread = start_http_server(port, addr=host, registry=REGISTRY)
            except OSError as exc:
                raise ExporterError(
                    f"cannot serve /metrics on {host}:{port} ({exc}); set FLEETGEN_METRICS_PORT "
                    "to a free port, or 0 to turn metrics off"
                ) from exc
            bound = int(self._server.server_port)
            log.info("metrics: serving http://%s:%d/metrics", host, bound)
            return bound

    def stop(self) -> None:
        with self._lock:
            if self._server is None:
                return
            self._server.shutdown()
            self._server.server_close()
            if self._thread is not None:
                self._thread.join(timeout=5)
            self._server = self._thread = None


_exporter = _Exporter()


def start_exporter(port: int, host: str = DEFAULT_HOST) -> int:
    """Serve this process's `/metrics` on host:port (0 = any free port); return the bound port.

    Idempotent per process: later calls return the port of the first. Raises ExporterError
    when the port cannot be bound.
    """
    return _exporter.start(port, host)


def stop_exporter() -> None:
    """Close the `/metrics` server if one runs (worker shutdown, tests)."""
    _exporter.stop()


def exporter_port(configured: int | None, queues: Iterable[str]) -> int | None:
    """The port a worker consuming `queues` should serve on, or None for "no metrics".

    `configured` is FLEETGEN_METRICS_PORT: a number wins, 0 turns metrics off; unset means
    20000+N for the worker's gpuN or gpuN-M queue (None when it consumes no such queue).
    """
    if configured is not None:
        return configured or None
    gpus = [int(m.group(1)) for q in queues if (m := keys.GPU_QUEUE.match(q))]
    return keys.METRICS_BASE_PORT + gpus[0] if len(gpus) == 1 else None


class _Sent(NamedTuple):
    """One (job, worker, server)'s children for every prompt sent."""

    in_flight: Gauge
    queue_wait: Histogram


class _Answered(NamedTuple):
    """Its children for answered prompts only (a job whose prompts all fail shows none)."""

    input_tokens: Counter
    output_tokens: Counter
    reasoning_tokens: Counter
    latency: Histogram


# `.labels()` takes a lock and builds a key on every call, and a prompt made six of them:
# looked up once per job and kept until `forget_job` removes the job's series.
@functools.cache
def _sent(job: str, worker: str, server: str) -> _Sent:
    return _Sent(IN_FLIGHT.labels(job, worker, server), QUEUE_WAIT.labels(job, worker, server))


@functools.cache
def _answered(job: str, worker: str, server: str) -> _Answered:
    labels = (job, worker, server)
    return _Answered(INPUT_TOKENS.labels(*labels), OUTPUT_TOKENS.labels(*labels),
                     REASONING_TOKENS.labels(*labels), REQUEST_LATENCY.labels(*labels))


def prompt_finished(
    job: str,
    worker: str,
    server: str,
    *,
    ok: bool,
    finish_reason: str | None,
    error_code: str | None,
    input_tokens: int,
    output_tokens: int,
    reasoning_tokens: int,
    latency_s: float,
    queue_wait_s: float,
) -> None:
    """Count one prompt that reached its final record (answered, or failed for good).

    Latency is observed for answered prompts only: a failure's time mixes instant 400s with
    hour-long timeouts and says nothing about generation speed.
    """
    _sent(job, worker, server).queue_wait.observe(queue_wait_s)
    if not ok:
        PROMPTS_FAILED.labels(job, worker, server, error_code or "unknown").inc()
        return
    PROMPTS_DONE.labels(job, worker, server, finish_reason or "none").inc()
    series = _answered(job, worker, server)
    series.input_tokens.inc(input_tokens)
    series.output_tokens.inc(output_tokens)
    series.reasoning_tokens.inc(reasoning_tokens)
    series.latency.observe(latency_s)


def request_started(job: str, worker: str, server: str) -> None:
    """One more request in flight to `server`."""
    _sent(job, worker, server).in_flight.inc()


def request_ended(job: str, worker: str, server: str) -> None:
    """One request answered, failed or cancelled: call it in a `finally`."""
    _sent(job, worker, server).in_flight.dec()


def rollout_started(job: str, worker: str, server: str) -> None:
    ROLLOUTS_RUNNING.labels(job, worker, server).inc()


def rollout_ended(job: str, worker: str, server: str) -> None:
    """One rollout ended (answered, failed or held): call it in a `finally`."""
    ROLLOUTS_RUNNING.labels(job, worker, server).dec()


def rollout_call(job: str, worker: str, server: str, *, journaled: bool) -> None:
    ROLLOUT_CALLS.labels(job, worker, server, "journal" if journaled else "server").inc()


def batch_finished(job: str, worker: str, server: str, *, duration_s: float, status: str) -> None:
    """Record one batch delivery's wall time; `status` is Outcome.status (done, stopped ...)."""
    BATCH_DURATION.labels(job, worker, server, status).observe(duration_s)


def job_series() -> set[str]:
    """The jobs this process serves series of."""
    return {values[0] for family, names in _BY_JOB for values in _label_values(family, names)}


def forget_job(job: str) -> None:
    """Remove every series labelled with `job` (it finished). A request still in flight for it
    counts on a detached child, which nothing serves."""
    for family, names in _BY_JOB:
        for values in _label_values(family, names):
            if values[0] == job:
                family.remove(*values)
    # The cached children of every job go: the others are found again (`.labels()` returns
    # the same child), the finished job's are not kept alive.
    _sent.cache_clear()
    _answered.cache_clear()


def _label_values(family: Counter | Gauge | Histogram, names: tuple[str, ...]) -> set[tuple[str, ...]]:
    """The label values of each series of `family` (a histogram's `le` and suffixes aside)."""
    return {tuple(sample.labels[n] for n in names)
            for metric in family.collect() for sample in metric.samples
            if all(n in sample.labels for n in names)}


def set_server_capacity(worker: str, server: str, effective: int, limit: int) -> None:
    """Publish the server's effective capacity and the worker's in-flight cap derived from it."""
    SERVER_CAPACITY.labels(worker, server).set(effective)
    IN_FLIGHT_LIMIT.labels(worker, server).set(limit)


def request_refused(worker: str, server: str, cause: str, status: int | None) -> None:
    """One request the server did not answer, by cause (workers/flow.py)."""
    SERVER_REQUESTS.labels(worker, server, cause, "" if status is None else str(status)).inc()


def server_hung(worker: str, server: str) -> None:
    """The worker found its server hung (workers/healthcheck.py)."""
    SERVER_HANGS.labels(worker, server).inc()


def set_in_rotation(worker: str, server: str, in_rotation: bool) -> None:
    IN_ROTATION.labels(worker, server).set(1 if in_rotation else 0)

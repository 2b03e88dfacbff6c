"""The worker's `/metrics`: scraped over HTTP and parsed the way Prometheus parses it."""

from __future__ import annotations

import socket
import threading
import uuid
from collections.abc import Iterator

import httpx
import prometheus_client
import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from workers import metrics

WORKER = "gpu0@node1"
SERVER = "http://127.0.0.1:30000"


@pytest.fixture(scope="module")
def port() -> Iterator[int]:
    # One server for the module: closing one takes up to 0.5 s (its poll interval).
    bound = metrics.start_exporter(0)
    yield bound
    metrics.stop_exporter()


@pytest.fixture
def job() -> str:
    # The registry lives as long as the process: a fresh job label isolates each test.
    return f"job-{uuid.uuid4().hex[:8]}"


def scrape(port: int) -> list[Sample]:
    response = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5)
    assert response.status_code == 200
    return [s for family in text_string_to_metric_families(response.text) for s in family.samples]


def value(samples: list[Sample], name: str, **labels: str) -> float:
    found = [s.value for s in samples if s.name == name and labels.items() <= s.labels.items()]
    assert len(found) == 1, f"{name}{labels}: {len(found)} samples"
    return found[0]


def finish(job: str, worker: str = WORKER, *, ok: bool = True, finish_reason: str | None = "stop",
           error_code: str | None = None, latency_s: float = 12.0, queue_wait_s: float = 0.02,
           tokens: tuple[int, int, int] = (100, 400, 300)) -> None:
    metrics.prompt_finished(
        job, worker, SERVER, ok=ok, finish_reason=finish_reason, error_code=error_code,
        input_tokens=tokens[0], output_tokens=tokens[1], reasoning_tokens=tokens[2],
        latency_s=latency_s, queue_wait_s=queue_wait_s,
    )


def test_answered_prompts_are_counted_by_finish_reason_with_their_tokens(port: int, job: str) -> None:
    finish(job, finish_reason="stop", tokens=(100, 400, 300))
    finish(job, finish_reason="stop", tokens=(50, 200, 0))
    finish(job, finish_reason="length", tokens=(10, 2000, 1990))
    finish(job, finish_reason=None, tokens=(1, 1, 0))
    samples = scrape(port)
    labels = {"job": job, "worker": WORKER, "server": SERVER}
    assert value(samples, "fleetgen_prompts_done_total", **labels, finish_reason="stop") == 2
    assert value(samples, "fleetgen_prompts_done_total", **labels, finish_reason="length") == 1
    assert value(samples, "fleetgen_prompts_done_total", **labels, finish_reason="none") == 1
    assert value(samples, "fleetgen_input_tokens_total", **labels) == 161
    assert value(samples, "fleetgen_output_tokens_total", **labels) == 2601
    assert value(samples, "fleetgen_reasoning_tokens_total", **labels) == 2290


def test_failed_prompts_are_counted_by_reason_and_add_no_latency_or_tokens(port: int, job: str) -> None:
    finish(job, ok=False, finish_reason=None, error_code="context_length_exceeded", latency_s=0.01)
    finish(job, ok=False, finish_reason=None, error_code="server_error", latency_s=3600.0)
    finish(job, ok=False, finish_reason=None, error_code=None)
    samples = scrape(port)
    labels = {"job": job, "worker": WORKER, "server": SERVER}
    for reason in ("context_length_exceeded", "server_error", "unknown"):
        assert value(samples, "fleetgen_prompts_failed_total", **labels, reason=reason) == 1
    assert not [s for s in samples if s.labels.get("job") == job
                and s.name.startswith(("fleetgen_prompts_done", "fleetgen_request_latency",
                                       "fleetgen_input_tokens"))]
    # Every final prompt waited for a slot, answered or not.
    assert value(samples, "fleetgen_request_queue_wait_seconds_count", **labels) == 3


def test_latency_and_queue_wait_land_in_buckets_from_milliseconds_to_hours(port: int, job: str) -> None:
    finish(job, latency_s=0.05, queue_wait_s=0.0005)
    finish(job, latency_s=2 * 3600.0, queue_wait_s=45 * 60.0)
    samples = scrape(port)
    latency = "fleetgen_request_latency_seconds_bucket"
    wait = "fleetgen_request_queue_wait_seconds_bucket"
    assert value(samples, latency, job=job, le="0.1") == 1
    assert value(samples, latency, job=job, le="3600.0") == 1
    assert value(samples, latency, job=job, le="7200.0") == 2
    assert value(samples, latency, job=job, le="14400.0") == 2
    assert value(samples, wait, job=job, le="0.001") == 1
    assert value(samples, wait, job=job, le="1800.0") == 1
    assert value(samples, wait, job=job, le="3600.0") == 2
    assert value(samples, "fleetgen_request_latency_seconds_sum", job=job) == pytest.approx(7200.05)


def test_in_flight_rises_with_started_requests_and_falls_as_they_end(port: int, job: str) -> None:
    for _ in range(5):
        metrics.request_started(job, WORKER, SERVER)
    metrics.request_started(job, "gpu1@node1", "http://127.0.0.1:30001")
    metrics.request_ended(job, WORKER, SERVER)
    metrics.request_ended(job, WORKER, SERVER)
    samples = scrape(port)
    assert value(samples, "fleetgen_requests_in_flight", job=job, worker=WORKER, server=SERVER) == 3
    assert value(samples, "fleetgen_requests_in_flight", job=job, worker="gpu1@node1") == 1


def test_batches_are_timed_by_status_and_capacity_is_published_per_server(port: int, job: str) -> None:
    metrics.batch_finished(job, WORKER, SERVER, duration_s=300.0, status="done")
    metrics.batch_finished(job, WORKER, SERVER, duration_s=0.5, status="already-done")
    metrics.set_server_capacity(WORKER, SERVER, effective=48, limit=52)
    samples = scrape(port)
    batch = "fleetgen_batch_duration_seconds"
    assert value(samples, f"{batch}_count", job=job, status="done") == 1
    assert value(samples, f"{batch}_bucket", job=job, status="done", le="120.0") == 0
    assert value(samples, f"{batch}_bucket", job=job, status="done", le="300.0") == 1
    assert value(samples, f"{batch}_bucket", job=job, status="already-done", le="1.0") == 1
    assert value(samples, "fleetgen_server_max_running_requests", worker=WORKER, server=SERVER) == 48
    assert value(samples, "fleetgen_worker_max_in_flight_requests", worker=WORKER, server=SERVER) == 52


def test_counts_from_many_threads_add_up_exactly(port: int, job: str) -> None:
    def work() -> None:
        for _ in range(500):
            metrics.request_started(job, WORKER, SERVER)
            finish(job, tokens=(1, 2, 1))
            metrics.request_ended(job, WORKER, SERVER)

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    samples = scrape(port)
    assert value(samples, "fleetgen_prompts_done_total", job=job, finish_reason="stop") == 4000
    assert value(samples, "fleetgen_output_tokens_total", job=job) == 8000
    assert value(samples, "fleetgen_requests_in_flight", job=job) == 0


def test_the_exporter_starts_once_per_process_on_its_own_registry(port: int, job: str) -> None:
    finish(job)
    assert metrics.start_exporter(0) == port
    assert metrics.start_exporter(port) == port
    names = {s.name for s in scrape(port)}
    assert "process_resident_memory_bytes" in names
    assert "fleetgen_prompts_done_total" in names
    assert not [n for n in names if n.endswith("_created")]
    # A private registry: a library's metrics on the global one never leak into ours, nor ours
    # into theirs.
    assert b"fleetgen_" not in prometheus_client.generate_latest(prometheus_client.REGISTRY)


def test_a_taken_port_raises_a_named_error_and_a_free_one_works_after(port: int) -> None:
    metrics.stop_exporter()
    with pytest.raises(httpx.ConnectError):
        scrape(port)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        with pytest.raises(metrics.ExporterError, match=f"127.0.0.1:{busy}.*FLEETGEN_METRICS_PORT"):
            metrics.start_exporter(busy)
    assert metrics.start_exporter(port) == port
    assert scrape(port)


@pytest.mark.parametrize(
    ("configured", "queues", "expected"),
    [
        (None, ["gpu0", "fleetgen"], 20000),
        (None, ["gpu7", "fleetgen"], 20007),
        (None, ["gpu4-7", "fleetgen"], 20004),  # a server over GPUs 4-7: its lead GPU's port
        (9555, ["gpu3", "fleetgen"], 9555),
        (0, ["gpu3", "fleetgen"], None),
        (None, ["fleetgen"], None),
    ],
)
def test_the_port_is_20000_plus_the_gpu_unless_configured(
    configured: int | None, queues: list[str], expected: int | None
) -> None:
    assert metrics.exporter_port(configured, queues) == expected

"""A worker rides out what real servers do under stress, by itself (workers/flow.py).

Each cause of a request not being answered has one response, and each is driven here end to
end against the simulator's misbehaviours (launcher/sim, docs/development/simulator.md):

- a server full and saying so (429 with Retry-After, 503 while /health is fine): the job runs
  to the end, no attempt spent, few refusals, no request loop;
- a proxy answering 502 for 20 s: the server goes out of rotation and back, the job never
  pauses and no prompt fails;
- one sick server of two: the job finishes on the other, and `status` names the sick one;
- thirty prompts too long in a row: they fail alone, the job never pauses, and a requeue round
  of them fails alone again;
- a server failing a third of its requests: `status` says so;
- a killed worker: shown lost, its requests out of the in-flight total.

A refusal every server gives (a model none serves) still pauses the job:
tests/fleetgen/test_breaker.py. The figures of each (refusals per second, time to fill a
server) are in tests/perf/flow.py; nothing here asserts a time or a rate of the machine.
"""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from fleetgen.fleet import registry
from fleetgen.jobview import JobStatus, job_status
from fleetgen.ledger import Ledger
from fleetgen.poll import wait_until
from tests.stack import Stack, chat_rows, iter_ids, wait_job_done, write_jsonl

pytestmark = pytest.mark.e2e

# Short answers, fast: a job of a few hundred prompts runs in seconds on an idle machine.
QUICK = ("--decode-tps", "100", "--mean-output-tokens", "60", "--speed", "10")


def sim_stats(url: str) -> dict[str, Any]:
    stats: dict[str, Any] = httpx.get(f"{url}/sim/stats", timeout=5).json()
    return stats


def misbehave(url: str, **what: Any) -> None:
    httpx.post(f"{url}/sim/misbehave", json=what, timeout=5).raise_for_status()


def enqueue(stack: Stack, tmp_path: Path, job: str, rows: list[dict[str, Any]],
            *flags: str) -> Path:
    src = write_jsonl(tmp_path / f"{job}.jsonl", rows)
    out = tmp_path / "out"
    stack.producer("enqueue", str(src), "--job", job, "--output", str(out), "--batch-size", "10",
                   "--no-canary", *flags)
    return out


def exported(stack: Stack, tmp_path: Path, job: str) -> list[dict[str, Any]]:
    path = tmp_path / f"{job}-export.jsonl"
    stack.producer("export", job, "--to", str(path))
    return [orjson.loads(x) for x in path.read_bytes().splitlines()]


def done_never_paused(stack: Stack, job: str, timeout: float) -> JobStatus:
    """Wait for the job to end done; fail at once if it was ever seen paused."""
    def never_paused(status: JobStatus) -> None:
        assert status.state != "paused", f"{status.reason}\n{stack.logs()}"

    return wait_job_done(stack, job, timeout=timeout, on_tick=never_paused)


def marked_rows(n: int, marker: str, marked: range) -> list[dict[str, Any]]:
    """n one-line prompts, those at the indices of `marked` carrying `marker`."""
    return [{"id": f"q{i:04d}", "prompt": f"Question {i}" + (f", {marker}." if i in marked
                                                              else ".")} for i in range(n)]


def exactly_once(lines: list[dict[str, Any]], rows: list[dict[str, Any]]) -> None:
    ids = [x.get("custom_id") or x["id"] for x in lines]
    assert sorted(ids) == sorted(iter_ids(rows)), "an id missing or twice in the export"


def first_attempts_only(lines: list[dict[str, Any]]) -> None:
    """No batch spent an attempt: every record comes from its batch's first attempt."""
    spent = sorted({x["attempt"] for x in lines} - {1})
    assert not spent, f"attempts spent: {spent}"


def done_clean(stack: Stack, tmp_path: Path, job: str, rows: list[dict[str, Any]],
               timeout: float) -> list[dict[str, Any]]:
    """The job ends done, never paused, every prompt exported once as an answer, no attempt
    spent; its export's lines."""
    status = done_never_paused(stack, job, timeout=timeout)
    lines = exported(stack, tmp_path, job)
    exactly_once(lines, rows)
    assert status.failed == 0 and not any("error" in x for x in lines)
    first_attempts_only(lines)
    return lines


def test_a_server_that_sheds_load_with_429_runs_the_job_to_the_end_spending_nothing(
        stack: Stack, tmp_path: Path) -> None:
    _, url = stack.sim("sim0", *QUICK, "--flavor", "strict", "--max-running-requests", "16",
                       "--overload", "429", "--retry-after", "1")
    stack.worker(0, url)
    rows = chat_rows(200)
    enqueue(stack, tmp_path, "shed", rows)
    done_clean(stack, tmp_path, "shed", rows, timeout=240)
    stats = sim_stats(url)
    # Refused requests are resent after the server's Retry-After under a cut ceiling: a few
    # per answer at most, not dozens (a worker that resends at once makes ~45 per answer).
    assert stats["refused"].get("429", 0) <= len(rows), stats


def test_a_503_while_health_is_fine_is_waited_out_without_a_request_loop(
        stack: Stack, tmp_path: Path) -> None:
    # SGLang with a waiting queue of 0 refuses every request beyond its 4 running with 503,
    # while /health says 200; the worker's queue margin alone would be refused at once.
    _, url = stack.sim("sim0", *QUICK, "--max-running-requests", "4",
                       "--max-queued-requests", "0")
    stack.worker(0, url)
    rows = chat_rows(100)
    enqueue(stack, tmp_path, "queue-full", rows)
    started = time.monotonic()
    status = done_never_paused(stack, "queue-full", timeout=240)
    took_s = time.monotonic() - started
    lines = exported(stack, tmp_path, "queue-full")
    exactly_once(lines, rows)
    assert status.failed == 0
    first_attempts_only(lines)
    stats = sim_stats(url)
    assert stats["refused"].get("503", 0) <= len(rows), stats
    # Detection and health endpoints are each asked about once a second at most, whatever the
    # refusals (a worker that re-detects the server after each 503 asks tens of thousands).
    for path, asked in stats["probes"].items():
        assert asked <= 2 * took_s + 30, (path, asked, took_s)


def test_a_proxy_answering_502_for_20_seconds_is_waited_out_and_never_pauses_the_job(
        stack: Stack, tmp_path: Path) -> None:
    _, url = stack.sim("sim0", "--decode-tps", "100", "--mean-output-tokens", "100",
                         "--speed", "2", "--max-running-requests", "8")
    worker = stack.worker(0, url)
    rows = chat_rows(240)
    enqueue(stack, tmp_path, "proxy", rows)
    ledger = Ledger.from_url(stack.base_env["REDIS_URL"])
    wait_until(lambda: job_status(ledger, "proxy").done >= 20, 120, what="the job under way")
    # Far longer than a prompt's tries take (backoff under a second here) and than the breaker's
    # streak of failures needs: only taking the server out of rotation keeps prompts unfailed.
    misbehave(url, status=502, seconds=20, scope="chat")
    done_clean(stack, tmp_path, "proxy", rows, timeout=400)
    log = worker.log_path.read_text()
    assert re.search(r"taken out of rotation: \d+ requests of \d+ prompts failed in a row \(HTTP 502\)", log), \
        worker.log()
    assert "answered a probe; back in rotation" in log, worker.log()


def test_one_sick_server_of_two_the_job_finishes_on_the_other_and_status_names_it(
        stack: Stack, tmp_path: Path) -> None:
    _, healthy = stack.sim("sim0", *QUICK)
    _, sick = stack.sim("sim1", *QUICK, "--fail-rate", "1")
    stack.worker(0, healthy)
    stack.worker(1, sick)
    rows = chat_rows(300)
    enqueue(stack, tmp_path, "sick", rows)
    lines = done_clean(stack, tmp_path, "sick", rows, timeout=240)
    assert {x["worker"] for x in lines} == {"gpu0@test"}
    screen = stack.producer("status", "sick").stdout
    assert re.search(r"gpu1@test: out of rotation: \d+ requests of \d+ prompts failed in a row \(HTTP 500\)",
                     screen), screen
    assert "gpu1@test: 100% of requests failed in the last 5 min (HTTP 500: " in screen, screen
    fleet = orjson.loads(stack.producer("status", "sick", "--json").stdout)["fleet"]
    row = next(r for r in fleet if r["worker"] == "gpu1@test")
    assert row["worker_state"] == "out-of-rotation" and not row["health"]["in_rotation"]


def test_thirty_prompts_too_long_in_a_row_fail_alone_and_never_pause_the_job(
        stack: Stack, tmp_path: Path) -> None:
    marker = "far too long"
    _, url = stack.sim("sim0", *QUICK, "--fail-prompt", marker)
    stack.worker(0, url)
    # A dataset sorted by length: lines 61-90 are all too long for the context.
    rows = marked_rows(150, marker, range(60, 90))
    enqueue(stack, tmp_path, "long", rows)
    status = done_never_paused(stack, "long", timeout=240)
    assert (status.done, status.failed) == (120, 30)
    lines = exported(stack, tmp_path, "long")
    exactly_once(lines, rows)
    failed = sorted(x["custom_id"] for x in lines if "error" in x)
    assert failed == [f"q{i:04d}" for i in range(60, 90)]
    assert {x["error"]["code"] for x in lines if "error" in x} == {"context_length_exceeded"}
    # A requeue round of the same prompts fails them alone again, and pauses nothing.
    stack.producer("requeue", "long", "--failed")
    status = done_never_paused(stack, "long", timeout=240)
    assert (status.done, status.failed) == (120, 30)


def test_a_server_failing_a_third_of_its_requests_is_named_in_status(
        stack: Stack, tmp_path: Path) -> None:
    _, url = stack.sim("sim0", *QUICK, "--fail-rate", "0.33")
    stack.worker(0, url)
    rows = chat_rows(150)
    enqueue(stack, tmp_path, "third", rows)
    done_never_paused(stack, "third", timeout=240)
    exactly_once(exported(stack, tmp_path, "third"), rows)
    screen = stack.producer("status", "third").stdout
    line = next((x for x in screen.splitlines() if "gpu0@test: " in x and "% of requests failed"
                 in x), None)
    assert line is not None and "(HTTP 500: " in line, screen
    share = int(line.split("gpu0@test: ")[1].split("%")[0])
    assert 15 <= share <= 50, line


def test_a_killed_worker_is_shown_lost_and_its_requests_leave_the_in_flight_total(
        stack: Stack, tmp_path: Path) -> None:
    _, url = stack.sim("sim0", "--decode-tps", "20", "--mean-output-tokens", "400",
                       "--max-running-requests", "16")
    worker = stack.worker(0, url)
    enqueue(stack, tmp_path, "killed", chat_rows(200))
    ledger = Ledger.from_url(stack.base_env["REDIS_URL"])
    in_flight: Callable[[], int] = lambda: job_status(ledger, "killed").in_flight
    wait_until(lambda: in_flight() > 0, 60, what="requests in flight")
    os.kill(worker.pid, signal.SIGKILL)

    def gone() -> bool:
        entry = registry(ledger, time.time()).get("gpu0@test")
        return entry is not None and entry.state == "lost" and in_flight() == 0

    wait_until(gone, 60, what="the killed worker shown lost, its requests out of the total")

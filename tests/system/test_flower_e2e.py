"""Flower, seen through a real browser, while a real fleet runs a job.

Two simulated servers, two GPU workers, Flower started with fleetgen's config
(workers/flowerconfig.py) and a password, jobs enqueued with the producer; headless Chromium
renders Flower's pages (JavaScript included) and screenshots them to /tmp/flower-*.png for a
human to look at. The other tests pin down what docs/guides/flower.md#access-and-authentication
says about authentication.
"""

from __future__ import annotations

import html
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from fleetgen import keys
from fleetgen.ledger import Ledger
from fleetgen.poll import wait_until
from producer import control
from tests.browser import Browser
from tests.stack import (
    Stack,
    chat_rows,
    queue_depth,
    start_flower,
    wait_healthy,
    write_jsonl,
)

pytestmark = pytest.mark.e2e

USER, PASSWORD = "fleet", "s3cret-for-tests"
# Slow enough that every queue still holds batches while the browser looks: a request takes
# ~5 s and each server runs 4 at once.
SLOW_SIM = ("--max-running-requests", "4", "--decode-tps", "40", "--mean-output-tokens", "400",
            "--speed", "2")
WORKERS = ("gpu0@test", "gpu1@test")
# How long a condition seen through Chromium may take: it returns as soon as it holds. 30 s
# was too short once with the other core busy (the suite as CI runs it, a CPU hog beside).
BROWSER_WAIT_S = 120


@pytest.fixture
def stack(tmp_path: Path, redis_url: str, redis_client: Any) -> Iterator[Stack]:
    # Outputs go to a folder: Flower is about the broker, S3 plays no part.
    s = Stack(tmp_path, {"REDIS_URL": redis_url})
    try:
        yield s
    finally:
        # The jobs are meant to be unfinished: a warm shutdown would wait for running batches.
        for proc in s.procs:
            if proc.name.startswith("gpu"):
                proc.kill()
        s.close()


def queue_rows(broker_dom: str) -> dict[str, int]:
    """Queue name -> Messages, from the /broker page's table."""
    rows = re.findall(r'<tr id="([^"]+)">\s*<td>\1</td>\s*<td[^>]*>(\d[\d,]*)</td>', broker_dom)
    return {name: int(count.replace(",", "")) for name, count in rows}


def enqueue(stack: Stack, tmp: Path, job: str, queue: str, prompts: int, batch_size: int) -> None:
    src = write_jsonl(tmp / f"{job}.jsonl", chat_rows(prompts, prefix=job))
    stack.producer("enqueue", str(src), "--job", job, "--queue", queue,
                   "--output", str(tmp / "out"), "--batch-size", str(batch_size), "--no-canary")


def test_flower_shows_workers_queue_depths_and_batches_of_a_paused_job_as_paused_not_failed(
    stack: Stack, chromium: Browser, tmp_path: Path, redis_client: Any
) -> None:
    _, url0 = stack.sim("sim0", *SLOW_SIM)
    _, url1 = stack.sim("sim1", *SLOW_SIM)
    # Flower runs before the workers, as a long-lived Flower does when a fleet (re)starts.
    proc, base = start_flower(stack, f"--basic-auth={USER}:{PASSWORD}")
    wait_healthy(proc, base)
    # Chromium sends URL credentials on the 401 challenge, for the page and its XHRs alike.
    flower = base.replace("http://", f"http://{USER}:{PASSWORD}@")
    # A paused job's batches are dropped with a reason; they sit first in gpu1's queue.
    enqueue(stack, tmp_path, "held", "gpu1", prompts=4, batch_size=2)
    control.pause(Ledger(redis_client), "held", "paused by test operator")
    enqueue(stack, tmp_path, "pinned0", "gpu0", prompts=40, batch_size=4)
    enqueue(stack, tmp_path, "pinned1", "gpu1", prompts=40, batch_size=4)
    enqueue(stack, tmp_path, "shared", keys.SHARED_QUEUE, prompts=20, batch_size=4)
    stack.worker(0, url0)
    stack.worker(1, url1)
    # Workers drain their own gpuN queue first, so nobody takes from the shared one yet.
    assert queue_depth(redis_client, keys.SHARED_QUEUE) == 5

    dashboard = chromium.dom(f"{flower}/")
    for name in WORKERS:
        assert name in dashboard
    assert re.search(r'id="workers-online">2<', dashboard), "dashboard JS did not count 2 online"

    # Flower lists the queues workers reported when it last inspected them (at its start,
    # before any worker was up), else task_default_queue + task_queues: only the shared queue.
    assert queue_rows(chromium.dom(f"{flower}/broker")).keys() == {keys.SHARED_QUEUE}
    refresh = httpx.get(f"{base}/api/workers?refresh=1", auth=(USER, PASSWORD), timeout=10)
    assert refresh.status_code == 200
    lengths: dict[str, int] = {}

    def broker_lists_every_queue() -> bool:
        before = {q: queue_depth(redis_client, q) for q in ("gpu0", "gpu1")}
        lengths.update(queue_rows(chromium.dom(f"{flower}/broker")))
        after = {q: queue_depth(redis_client, q) for q in ("gpu0", "gpu1")}
        if {"gpu0", "gpu1"} - lengths.keys():
            return False
        # The page shows LLEN at the moment it was rendered: between the two readings.
        assert all(after[q] <= lengths[q] <= before[q] for q in before), (before, lengths, after)
        return True

    # Each look renders the page in Chromium: seconds apiece on a busy machine.
    wait_until(broker_lists_every_queue, BROWSER_WAIT_S, interval=0.5,
               what="gpu0 and gpu1 on /broker")
    assert lengths[keys.SHARED_QUEUE] == 5
    assert lengths["gpu0"] >= 1 and lengths["gpu1"] >= 1

    rows: dict[str, str] = {}

    def tasks_page_lists_the_dropped_batches() -> bool:
        page = chromium.dom(f"{flower}/tasks")
        rows.update(re.findall(r'<tr id="(held:b00000[12]):[^"]*"[^>]*>(.*?)</tr>', page))
        return len(rows) == 2 and all("SUCCESS" in row for row in rows.values())

    wait_until(tasks_page_lists_the_dropped_batches, BROWSER_WAIT_S, interval=0.5,
               what="2 dropped batches")
    for task, row in rows.items():
        batch = task.split(":")[1]
        cells = html.unescape(row)
        # Dropped because the job is paused: that is what the result says, and no failure.
        assert f">held {batch}<" in cells
        assert (f"'status': 'paused', 'job': 'held', 'batch': '{batch}', 'reason': 'job held is "
                f"paused: paused by test operator; batch {batch} left for `python -m producer "
                "resume held`'") in cells
        assert "FAILURE" not in cells and "JobNotRunningError" not in cells
    failed = httpx.get(f"{base}/api/tasks", params={"state": "FAILURE"}, auth=(USER, PASSWORD),
                       timeout=10)
    assert failed.status_code == 200 and failed.json() == {}

    shots = {page: chromium.screenshot(f"{flower}{path}", tmp_path / f"flower-{page}.png")
             for page, path in (("dashboard", "/"), ("broker", "/broker"), ("tasks", "/tasks"))}
    for page, shot in shots.items():
        shutil.copy(shot, f"/tmp/flower-{page}.png")


def test_flower_asks_for_the_password_everywhere_except_metrics_and_healthcheck(
    tmp_path: Path, redis_url: str, redis_client: Any
) -> None:
    stack = Stack(tmp_path, {"REDIS_URL": redis_url})
    try:
        # From the environment, as docs/guides/flower.md#access-and-authentication advises: a flag
        # would show the password in ps.
        proc, base = start_flower(stack, "--read_only",
                                  env={"FLOWER_BASIC_AUTH": f"{USER}:{PASSWORD}"})
        wait_healthy(proc, base)
        for path in ("/", "/broker", "/tasks", "/api/workers", "/api/queues/length"):
            denied = httpx.get(f"{base}{path}", timeout=10)
            assert denied.status_code == 401, path
            if not path.startswith("/api/"):  # the API answers 401 without a challenge
                assert denied.headers["www-authenticate"] == 'Basic realm="flower"'
            assert httpx.get(f"{base}{path}", auth=(USER, PASSWORD), timeout=10).status_code == 200
        assert httpx.get(f"{base}/", auth=(USER, "wrong"), timeout=10).status_code == 401
        metrics = httpx.get(f"{base}/metrics", timeout=10)
        assert metrics.status_code == 200 and "# TYPE flower_worker_online gauge" in metrics.text
        assert httpx.get(f"{base}/healthcheck", timeout=10).text == "OK"
        shutdown = httpx.post(f"{base}/api/worker/shutdown/gpu0@test", auth=(USER, PASSWORD),
                              timeout=10)
        assert shutdown.status_code == 403 and "Read only" in shutdown.text
    finally:
        stack.close()


def test_without_auth_flower_pages_are_open_and_its_api_needs_flower_unauthenticated_api(
    tmp_path: Path, redis_url: str, redis_client: Any
) -> None:
    stack = Stack(tmp_path, {"REDIS_URL": redis_url})
    try:
        closed, closed_base = start_flower(stack, name="flower-closed-api")
        open_, open_base = start_flower(stack, env={"FLOWER_UNAUTHENTICATED_API": "true"},
                                        name="flower-open-api")
        wait_healthy(closed, closed_base)
        wait_healthy(open_, open_base)
        for base in (closed_base, open_base):
            assert httpx.get(f"{base}/broker", timeout=10).status_code == 200
        refused = httpx.get(f"{closed_base}/api/workers", timeout=10)
        assert refused.status_code == 401 and "FLOWER_UNAUTHENTICATED_API" in refused.text
        served = httpx.get(f"{open_base}/api/workers", timeout=10)
        assert served.status_code == 200
        # ... and to every web origin: any page in a browser on this host may call it.
        assert served.headers["access-control-allow-origin"] == "*"
    finally:
        stack.close()

"""A worker pointed at the wrong server says what is wrong, in one line told rarely, and is not
ready until a server it can use answers there (workers/discovery.py).

One worker meets, on one port: nothing listening, then a plain web server (`python -m
http.server`), then the simulator. Its log names each cause once (the worker tries every
second), its fleetgen ready line comes only with the simulator, the registry and `producer
status` show why it waits, and a job enqueued while it waited runs once the simulator is there.
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import pytest

from fleetgen.fleet import WorkerEntry, registry
from fleetgen.ledger import Ledger
from fleetgen.ports import free_port
from tests.sim_helpers import wait_until
from tests.stack import PYTHON, Proc, Stack, chat_rows
from tests.system.test_flow_control import QUICK, done_clean, enqueue

pytestmark = pytest.mark.e2e

WORKER = "gpu0@test"
WAITING = f"worker {WORKER} started: waiting for its server: "
READY = re.compile(rf"worker {re.escape(WORKER)} ready: queues gpu0,fleetgen, server (\S+), "
                   r"requests in flight up to (\d+) \(([^)]*)\)")
CHAT_POSTS = '"POST /v1/chat/completions '


def log_of(proc: Proc) -> str:
    """The whole log (`Proc.log` keeps only its tail)."""
    return proc.log_path.read_text(errors="replace")


def entry_of(redis_client: Any) -> WorkerEntry | None:
    return registry(Ledger(redis_client), time.time()).get(WORKER)


def shows(redis_client: Any, why: str) -> bool:
    entry = entry_of(redis_client)
    return (entry is not None and entry.state == "server-down"
            and entry.last_error is not None and entry.last_error.error == why)


def test_a_worker_pointed_at_nothing_then_a_web_server_says_why_rarely_and_is_ready_with_a_server(
        stack: Stack, tmp_path: Path, redis_client: Any) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    nothing = f"nothing listens at {url}: start the server or set FLEETGEN_SERVER_URL"
    not_openai = f"{url}: /v1/chat/completions answered 501: not an OpenAI-compatible server"
    worker = stack.worker(0, url)  # back at Celery's own "ready." line

    wait_until(lambda: WAITING + nothing in log_of(worker), what="the nothing-listens line")
    wait_until(lambda: shows(redis_client, nothing), what="the registry saying why")

    www = tmp_path / "www"
    www.mkdir()
    web = Proc("web", [PYTHON, "-m", "http.server", str(port), "--bind", "127.0.0.1",
                       "--directory", str(www)], stack.env(), tmp_path / "web.log").start()
    stack.procs.append(web)
    wait_until(lambda: WAITING + not_openai in log_of(worker), what="the not-OpenAI line")
    wait_until(lambda: shows(redis_client, not_openai), what="the registry saying why")
    # The worker tries the server every second; the line is not said again at each try.
    wait_until(lambda: log_of(web).count(CHAT_POSTS) >= 4, what="four tries of the web server")
    log = log_of(worker)
    assert log.count(WAITING + nothing) == 1 and log.count(WAITING + not_openai) == 1, log
    assert log.count(WAITING) == 2 and READY.search(log) is None, log
    assert "stopped taking batches" not in log and "capacity not readable" not in log, log

    rows = chat_rows(20)
    enqueue(stack, tmp_path, "wrong", rows, "--queue", "gpu0")
    status = stack.producer("status", "wrong").stdout
    row = next(line.split() for line in status.splitlines() if line.startswith(f"  {WORKER} "))
    assert row[1] == "server-down" and not_openai in status, status

    web.stop()
    stack.sim("sim0", *QUICK, port=port)
    ready = wait_until(lambda: READY.search(log_of(worker)), what="the worker's ready line")
    assert ready.group(1) == url and "effective_max_running_requests" in ready.group(3)
    done_clean(stack, tmp_path, "wrong", rows, timeout=60)
    # The registry follows within a beat of the ready line (a loaded machine's slow /health
    # may show one beat of `server-down` in between).
    def ready_entry() -> WorkerEntry | None:
        entry = entry_of(redis_client)
        return entry if entry is not None and entry.state == "ready" else None

    assert wait_until(ready_entry, what="the registry saying ready").last_error is None
    log = log_of(worker)
    assert len(READY.findall(log)) == 1 and log.index(WAITING) < ready.start(), log

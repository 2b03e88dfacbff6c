"""`python -m launcher sim` as a process: readiness, SIGTERM drain, fatal exits.

As in docs/reference/sglang.md#process and docs/reference/sglang.md#startup."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.sim_helpers import REPO, SimProcess, chat_body, gauge, wait_until

pytestmark = pytest.mark.e2e  # every test starts its own server processes


@pytest.fixture
def spawn(tmp_path: Path) -> Iterator[Any]:
    procs: list[SimProcess] = []

    def start(*flags: str) -> SimProcess:
        procs.append(SimProcess(tmp_path, *flags))
        return procs[-1]

    yield start
    for proc in procs:
        proc.close()


def test_a_plain_start_becomes_healthy_and_says_so(spawn: Any) -> None:
    # How fast (under 2 s) is a figure of `python -m tests.perf --only timings`.
    sim = spawn()
    sim.wait_healthy(timeout=60)
    log = sim.wait_for_line("The server is fired up and ready to roll!")
    for line in ("Load weight end.", "max_running_requests=4096", "Uvicorn running on",
                 "Prefill batch, #new-seq: 1, #new-token: 6,"):
        assert line in log


def test_health_is_503_with_an_empty_body_during_the_startup_delay(spawn: Any) -> None:
    sim = spawn("--startup-delay", "1.5")
    wait_until(sim.health, what="the port to accept connections")
    starting = httpx.get(sim.url + "/health")
    assert (starting.status_code, starting.content) == (503, b"")
    assert httpx.get(sim.url + "/v1/models").status_code == 200
    sim.wait_healthy()
    assert "fired up" in sim.log()


def test_sigterm_drains_in_flight_requests_then_exits_zero(spawn: Any) -> None:
    # The request takes 8 s: still draining when /health is asked, even on a loaded machine.
    sim = spawn("--decode-tps", "50")
    sim.wait_healthy()
    reply: dict[str, Any] = {}
    worker = threading.Thread(target=lambda: reply.update(httpx.post(
        sim.url + "/v1/chat/completions", json=chat_body(max_tokens=400, ignore_eos=True),
        timeout=60).json()))
    worker.start()
    wait_until(lambda: gauge(sim.url, "sglang:num_running_reqs") == 1, what="a running request")
    sim.proc.send_signal(signal.SIGTERM)
    sim.wait_for_line("SIGTERM received. signum=15 frame=None. Draining requests and shutting "
                      "down...")
    assert sim.health() == 503
    worker.join(timeout=60)
    assert sim.wait_exit(timeout=60) == 0
    assert reply["usage"]["completion_tokens"] == 400
    log = sim.log()
    assert "Gracefully exiting... Remaining number of requests 1." in log
    assert "Decode batch, #running-req: 1, #token: " in log


def test_forced_shutdown_exits_at_once(spawn: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SGL_FORCE_SHUTDOWN", "1")
    sim = spawn("--decode-tps", "5")
    sim.wait_healthy()
    threading.Thread(target=httpx.post, args=(sim.url + "/v1/chat/completions",),
                     kwargs={"json": chat_body(max_tokens=500), "timeout": 30},
                     daemon=True).start()
    wait_until(lambda: gauge(sim.url, "sglang:num_running_reqs") == 1, what="a running request")
    sim.proc.send_signal(signal.SIGTERM)
    assert sim.wait_exit(timeout=30) == 0  # a drain would take the request's 100 s


def test_crash_after_requests_logs_sigquit_and_dies_with_minus_nine(spawn: Any) -> None:
    sim = spawn("--instant", "--crash-after-requests", "1")
    sim.wait_healthy()
    first = httpx.post(sim.url + "/v1/chat/completions", json=chat_body(max_tokens=2))
    assert first.status_code == 200
    with pytest.raises(httpx.TransportError):
        httpx.post(sim.url + "/v1/chat/completions", json=chat_body(max_tokens=2))
    assert sim.wait_exit() == -signal.SIGKILL
    log = sim.log()
    assert "Scheduler hit an exception: Traceback (most recent call last):" in log
    assert "torch.OutOfMemoryError: CUDA out of memory." in log
    assert "SIGQUIT received. signum=3, frame=None. It usually means one child failed." in log


def test_crash_after_seconds_dies_with_minus_nine(spawn: Any) -> None:
    sim = spawn("--crash-after-seconds", "0.2")
    assert sim.wait_exit() == -signal.SIGKILL
    assert "fired up" in sim.log() and "SIGQUIT received." in sim.log()


def test_startup_oom_prints_sglangs_message_and_never_serves(spawn: Any) -> None:
    sim = spawn("--startup-oom")
    assert sim.wait_exit() == -signal.SIGKILL
    log = sim.log()
    assert ("RuntimeError: Not enough memory. Please try to increase --mem-fraction-static. "
            "Current value: mem_fraction_static=0.841") in log
    assert "Received sigquit from a child process. It usually means the child failed." in log
    assert "Uvicorn running" not in log


def test_unknown_flags_exit_2_with_sglangs_usage() -> None:
    result = subprocess.run([sys.executable, "-m", "launcher", "sim", "--no-such-flag"],
                            cwd=REPO, capture_output=True, text=True, timeout=30, check=False)
    assert result.returncode == 2
    assert result.stderr.startswith("usage: python -m launcher sim")
    assert "unrecognized arguments: --no-such-flag" in result.stderr

"""Shared helpers for the simulator tests: in-thread servers, subprocesses, metric scraping,
and an event loop on simulated time."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import selectors
import ssl
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import httpx

from fleetgen.poll import poll
from fleetgen.ports import free_port
from launcher.child import ChildProcess
from launcher.sim import SimConfig, serve_in_thread

T = TypeVar("T")
REPO = Path(__file__).resolve().parent.parent
# One SSL context for the tests' own httpx calls (`httpx.post(url, ..., verify=TLS)`): without
# it each call builds and loads one, for a plain-http URL too, and that is most of what a
# request to an in-thread simulator costs the test process.
TLS = ssl.create_default_context()


def config(*flags: str) -> SimConfig:
    """A SimConfig on a free port from SGLang-style flags."""
    return SimConfig.from_argv(["--port", "0", *flags])


@contextlib.contextmanager
def running_sim(*flags: str) -> Iterator[str]:
    """An in-thread simulator; yields its base URL once /health is 200."""
    with serve_in_thread(config(*flags)) as url:
        yield url


def chat_body(text: str = "Hello there", **extra: Any) -> dict[str, Any]:
    """A minimal chat request body."""
    return {"model": "m", "messages": [{"role": "user", "content": text}], **extra}


# Deadlines only stop a wait that would never end: generous, for a loaded 2-core machine.
WAIT_S = 30.0


def wait_until(condition: Callable[[], T | None], timeout: float = WAIT_S,
               what: str = "condition") -> T:
    """Poll `condition` until it returns a truthy value; fail after `timeout` seconds."""
    value = poll(lambda: condition() or None, timeout, interval_s=0.02)
    if value is None:
        raise AssertionError(f"timed out waiting for {what}")
    return value


def metric(text: str, name: str) -> float:
    """The value of the first sample of `name` (e.g. `sglang:num_running_reqs`)."""
    match = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE)
    if match is None:
        raise AssertionError(f"{name} not in /metrics")
    return float(match.group(1))


def metric_sum(text: str, name: str) -> float:
    """The sum of every sample of `name` over its label sets (e.g. both `stream` values)."""
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text,
                                            re.MULTILINE))


def gauge(url: str, name: str) -> float:
    """The current value of one /metrics sample of the server at `url`."""
    return metric(httpx.get(url + "/metrics", verify=TLS).text, name)


class SimProcess:
    """`python -m launcher sim ...` as a child process, its output in a file."""

    def __init__(self, tmp: Path, *flags: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = tmp / f"sim-{self.port}.log"
        self.child = ChildProcess(
            [sys.executable, "-m", "launcher", "sim", "--port", str(self.port), *flags],
            self.log_path, env={**os.environ, "PYTHONUNBUFFERED": "1"}, cwd=REPO)
        self.proc = self.child.popen

    def log(self) -> str:
        """Everything the process printed so far."""
        return self.log_path.read_text(errors="replace")

    def wait_for_line(self, text: str, timeout: float = WAIT_S) -> str:
        """Wait until the output contains `text`; the output so far."""
        wait_until(lambda: text in self.log(), timeout, repr(text))
        return self.log()

    def health(self) -> int | None:
        """/health's status code, or None if the port refuses connections."""
        try:
            return httpx.get(self.url + "/health", timeout=2).status_code
        except httpx.TransportError:
            return None

    def wait_healthy(self, timeout: float = WAIT_S) -> None:
        """Wait until /health answers 200."""
        wait_until(lambda: self.health() == 200, timeout, "/health == 200")

    def wait_exit(self, timeout: float = WAIT_S) -> int:
        """The exit code, once the process has ended."""
        return self.proc.wait(timeout=timeout)

    def close(self) -> None:
        """Kill the process (and anything it started) if it still runs."""
        self.child.kill_group()


class VirtualClockLoop(asyncio.SelectorEventLoop):
    """An asyncio loop on simulated time: waiting for the next timer takes no wall time.

    The simulator's scheduler keeps its timelines in loop time, so on this loop its figures
    are exact whatever else the machine runs. `advance` plays a callback that holds the loop.
    """

    def __init__(self) -> None:
        self.now = 0.0
        super().__init__(selector=_NoWait(self))

    def time(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        """Let `seconds` of loop time pass, as a callback busy for that long would."""
        self.now += seconds


class _NoWait(selectors.DefaultSelector):
    """Polls the loop's own file descriptors; a wait for a timer jumps the clock instead."""

    def __init__(self, loop: VirtualClockLoop) -> None:
        super().__init__()
        self.loop = loop

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        ready = super().select(0)
        if not ready and timeout:
            self.loop.advance(timeout)
        return ready

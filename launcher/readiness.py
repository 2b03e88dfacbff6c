"""Readiness of a starting server: the HTTP probe and the wait for `/health`.

Readiness polls `/health`, checks the return code and tails the log for fatal lines every
round, under one deadline (docs/reference/sglang.md#startup).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

import httpx

from launcher.clock import Clock
from launcher.logfollower import LogFollower, describe_exit, describe_fatal
from launcher.process import LaunchSpec, ServerProcess

# A healthy SGLang /health takes about 1 s and up to 20 s under load
# (docs/reference/sglang.md#health).
HEALTH_TIMEOUT_S = 30.0


class Probe(Protocol):
    """How the supervisor asks a server about itself (HTTP, or a fake in tests)."""

    async def healthy(self, url: str) -> bool: ...

    async def server_info(self, url: str) -> Mapping[str, object] | None: ...


class HttpProbe:
    """`/health` and `/server_info` over HTTP; never raises, an unreachable server is unhealthy."""

    def __init__(self, api_key: str | None = None, timeout_s: float = HEALTH_TIMEOUT_S) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # trust_env=False: a proxy from the environment must not see loopback health checks.
        self.client = httpx.AsyncClient(timeout=timeout_s, headers=headers, trust_env=False)

    async def healthy(self, url: str) -> bool:
        try:
            return (await self.client.get(f"{url}/health")).status_code == 200
        except httpx.HTTPError:
            return False

    async def server_info(self, url: str) -> Mapping[str, object] | None:
        # /server_info arrived 2025-11; older servers only have /get_server_info (§4.2).
        for path in ("/server_info", "/get_server_info"):
            try:
                response = await self.client.get(f"{url}{path}")
            except httpx.HTTPError:
                return None
            if response.status_code == 200:
                try:
                    body = response.json()
                except ValueError:
                    return None
                return body if isinstance(body, dict) else None
        return None

    async def aclose(self) -> None:
        await self.client.aclose()


@dataclass(frozen=True)
class StartOutcome:
    """How a start ended: ready, or failed with a reason (and the exit code if it exited)."""

    ready: bool
    reason: str | None = None
    exit_code: int | None = None
    elapsed_s: float = 0.0


async def wait_ready(
    proc: ServerProcess, spec: LaunchSpec, follower: LogFollower, probe: Probe, clock: Clock,
    timeout_s: float, poll_s: float, fatal_grace_s: float,
    interrupted: Callable[[], bool] = lambda: False,
) -> StartOutcome:
    """Poll until `/health` is 200, the process exits, a fatal line shows, or the deadline.

    After a fatal line the process gets `fatal_grace_s` to exit on its own (SGLang logs the
    root cause a few lines after `Scheduler hit an exception`), then the start counts as failed.
    """
    start = clock.now()
    fatal_at: float | None = None
    while True:
        follower.poll()
        code = proc.poll()
        elapsed = clock.now() - start
        if code is not None:
            follower.poll(final=True)
            reason = describe_exit(code, follower) + " (while starting)"
            return StartOutcome(False, reason, code, elapsed)
        if follower.fatal is not None:
            fatal_at = clock.now() if fatal_at is None else fatal_at
            if clock.now() - fatal_at >= fatal_grace_s:
                reason = (f"{describe_fatal(follower.fatal)}; "
                          f"still running {fatal_grace_s:.0f} s later")
                return StartOutcome(False, reason, None, elapsed)
        elif spec.port is not None and await probe.healthy(spec.url):
            return StartOutcome(True, None, None, clock.now() - start)
        if elapsed >= timeout_s:
            last = f"; last log line: {follower.tail[-1]}" if follower.tail else ""
            return StartOutcome(False, f"not ready after {timeout_s:.0f} s{last}", None, elapsed)
        if interrupted():
            return StartOutcome(False, "interrupted", None, elapsed)
        await clock.sleep(poll_s)

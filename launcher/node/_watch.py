"""Watching one server: its log since the start, `/health` until ready, then what it says.

    follower = LogFollower(spec.log_path)          # folds each new log line into a LogReport
    outcome = await wait_ready(proc, spec, follower, HttpProbe(), clock, 1800, 0.25, 5)
    reading = limits_reading(await probe.server_info(spec.url), follower.report)

Readiness polls `/health`, checks the return code and tails the log for fatal lines every
round, under one deadline (docs/reference/sglang.md#startup). Once ready, `/server_info` (or `/get_server_info` on
older builds) and the log together say what the server runs: its `Reading`. When a process
ends, `describe_exit` says why in one line: its code or signal, the fatal line and its hint.
"""

from __future__ import annotations

import signal
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, TypeVar

import httpx

from fleetgen.servers import ServerInfo, as_float, as_int, fetch_server_info
from launcher.child import ChildLike
from launcher.logs import HINTS, Fatal, LogReport, capacity_from_server_info, parse_line
from launcher.node._clock import Clock
from launcher.node._process import MARKER, LaunchSpec

# Enough lines to show an argparse error or a traceback's last frame in a failure reason.
TAIL_LINES = 8
# Per poll; a server logging faster than this is caught up over the next rounds.
MAX_READ_BYTES = 4 << 20


class LogFollower:
    """Reads what a server appended to its log since `offset`, folding it into a LogReport."""

    def __init__(self, path: Path, offset: int | None = None) -> None:
        self.path = path
        self.offset = offset if offset is not None else _size(path)
        self.report = LogReport(str(path))
        self.tail: deque[str] = deque(maxlen=TAIL_LINES)
        self._partial = b""

    @property
    def fatal(self) -> Fatal | None:
        """The most telling fatal line seen since this start (root causes outrank sigquit)."""
        return self.report.run.fatal

    def poll(self, final: bool = False) -> None:
        """Fold new complete lines (and, when `final`, an unterminated last line)."""
        try:
            with open(self.path, "rb") as log:
                log.seek(self.offset)
                chunk = log.read(MAX_READ_BYTES)
        except FileNotFoundError:
            return
        self.offset += len(chunk)
        lines = (self._partial + chunk).split(b"\n")
        self._partial = b"" if final else lines.pop()
        for raw in lines:
            # tqdm redraws with carriage returns; each redraw is a line of its own.
            for line in raw.decode("utf-8", "replace").split("\r"):
                self._fold(line)

    def _fold(self, line: str) -> None:
        self.report.lines += 1
        event = parse_line(line)
        if event is not None:
            self.report.add(event)
        if line.strip() and not line.startswith(MARKER):  # the tail is the server's own
            self.tail.append(line.strip())


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def describe_fatal(fatal: Fatal) -> str:
    """`kind: first line of the message (hint)`."""
    first = fatal.message.strip().splitlines()[0][:240] if fatal.message.strip() else fatal.kind
    return f"{fatal.kind}: {first} ({HINTS[fatal.kind]})"


def describe_exit(code: int, follower: LogFollower) -> str:
    """Why a process ended: its code or signal, then the fatal line or the last log line."""
    how = f"exited with code {code}" if code >= 0 else f"killed by {_signal_name(-code)}"
    if follower.fatal is not None:
        return f"{how}: {describe_fatal(follower.fatal)}"
    if code == -9:  # SGLang's own fatal path logs first; a silent -9 is usually the kernel
        how += " (the OS OOM killer? dmesg -T | grep -i oom)"
    if code == 2:
        how += " (bad arguments)"
    return f"{how}; last log line: {follower.tail[-1]}" if follower.tail else how


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


# Readiness.

# A healthy SGLang /health takes about 1 s and up to 20 s under load (docs/reference/sglang.md#health).
HEALTH_TIMEOUT_S = 30.0


class Probe(Protocol):
    """How the supervisor asks a server about itself (HTTP, or a fake in tests)."""

    async def healthy(self, url: str) -> bool: ...

    async def server_info(self, url: str) -> ServerInfo | None: ...


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

    async def server_info(self, url: str) -> ServerInfo | None:
        """What the server says (fleetgen/servers/_server_info.py); None if it did not say (the log
        then says what it can)."""
        try:
            return await fetch_server_info(self.client, url)
        except httpx.HTTPError:
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
    proc: ChildLike, spec: LaunchSpec, follower: LogFollower, probe: Probe, clock: Clock,
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


# What a ready server says about itself.

T = TypeVar("T")


@dataclass(frozen=True)
class Reading:
    """What a ready server says about itself: `/server_info` first, its log second."""

    version: str | None
    weights_gb: float | None
    kv_tokens: int | None
    mamba_slots: int | None
    max_total_num_tokens: int | None
    context_length: int | None
    chunked_prefill_size: int | None
    cuda_graph_max_bs: int | None
    requested: int | None
    effective: int | None  # per DP rank: the cap one scheduler runs at once
    binding: str | None
    reason: str
    # What the whole server runs at once, the sum over its DP ranks (ServerInfo.concurrency),
    # the figure a worker sizes its concurrency from (fleetgen.servers.server_capacity);
    # None when only its log said what it runs.
    concurrency: int | None = None

    def summary(self) -> str:
        """One line for the `ready` log line and `status`."""
        parts = [f"weights {_v(self.weights_gb)} GB", f"KV {_v(self.kv_tokens)} tokens"]
        if self.mamba_slots is not None:
            parts.append(f"Mamba {self.mamba_slots} slots")
        parts += [f"max_total_num_tokens {_v(self.max_total_num_tokens)}",
                  f"context {_v(self.context_length)}",
                  f"chunked prefill {_v(self.chunked_prefill_size)}",
                  f"cuda graph bs {_v(self.cuda_graph_max_bs)}",
                  f"max_running_requests {_v(self.effective)} (asked {self.requested or 'auto'})"]
        if self.concurrency is not None and self.concurrency != self.effective:
            parts.append(f"{self.concurrency} at once over its DP ranks")
        return ", ".join(parts) + f" -- {self.reason}"


def limits_reading(server: ServerInfo | None, report: LogReport) -> Reading:
    """A server's limits: what it said of itself (None if it did not) combined with what its log
    said. (Its live figures are `fleetgen.readings.read_server`'s.)"""
    log = report.to_json()
    cap = report.capacity()
    if server is not None and server.per_rank and server.per_rank[0] is not None:
        cap = capacity_from_server_info(server)
    state: Mapping[str, object] = server.ranks[0] if server and server.ranks else {}
    memory = server.memory if server else {}
    info = server.args if server else {}
    return Reading(
        version=server.version if server else None,
        weights_gb=_pick(as_float(memory.get("weight")), as_float(log["weights_gb"])),
        kv_tokens=_pick(as_int(log["kv_tokens"]), as_int(memory.get("token_capacity"))),
        mamba_slots=_pick(as_int(state.get("max_mamba_cache_size")),
                          as_int(log["mamba_slots"])),
        max_total_num_tokens=_pick(server.max_total_num_tokens if server else None,
                                   as_int(log["max_total_num_tokens"])),
        context_length=_pick(server.context_length if server else None,
                             as_int(log["context_len"])),
        chunked_prefill_size=_pick(server.chunked_prefill_size if server else None,
                                   as_int(log["chunked_prefill_size"])),
        cuda_graph_max_bs=_pick(as_int(log["cuda_graph_max_bs"]),
                                as_int(info.get("cuda_graph_max_bs_decode")),
                                as_int(info.get("cuda_graph_max_bs"))),
        requested=cap.requested, effective=cap.effective, binding=cap.binding,
        reason=cap.reason, concurrency=server.concurrency if server else None,
    )


def _pick(*values: T | None) -> T | None:
    return next((v for v in values if v is not None), None)


def _v(value: object) -> str:
    return "-" if value is None else str(value)

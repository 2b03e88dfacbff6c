"""One SGLang server process: its argv, spawning, readiness, reading its mind, stopping it.

    argv = build_argv(["sglang", "serve"], "/dev/shm/Qwen3.6-27B", 30000, 31000, user_args)
    proc = spawn(LaunchSpec("gpu0", argv, env, Path("logs/sglang_gpu0.log"), 30000))
    outcome = await wait_ready(proc, spec, LogFollower(spec.log_path), probe, clock, ...)
    await stop_process(proc, clock, timeout_s=60)

The server runs in its own session and process group with stdout and stderr merged into one
log file per GPU (contract §1: SGLang logs to both). Readiness polls `/health`, checks the
return code and tails the log for fatal lines every round, under one deadline (contract §3).

Errors (the launcher's tree; `gpus.py` and `profile.py` add their own):

    NodeError
      PortBusyError     # a port a server needs is taken
      ProfileError      # a bad profile file (profile.py) or server argument
      NoGpuError        # gpus.py: nvidia-smi missing or failed, index absent
      GpuSpecError      # gpus.py: a bad --gpus value
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, TypeVar

import httpx

from launcher.capacity import as_float, as_int, from_server_info
from launcher.embedded import die_with_parent, port_is_free
from launcher.explain import HINTS, LogReport
from launcher.logparse import Fatal, parse_line

T = TypeVar("T")
HOST = "127.0.0.1"
MARKER = "[launcher]"  # starts the line spawn() writes before each start
SECRET_FLAGS = ("--api-key", "--admin-api-key")
# Enough lines to show an argparse error or a traceback's last frame in a failure reason.
TAIL_LINES = 8
# Per poll; a server logging faster than this is caught up over the next rounds.
MAX_READ_BYTES = 4 << 20
# A healthy SGLang /health takes about 1 s and up to 20 s under load (contract §4.1).
HEALTH_TIMEOUT_S = 30.0


class NodeError(Exception):
    """Base class: the node cannot be brought up or controlled as asked."""


class PortBusyError(NodeError):
    """A port a server must listen on is already taken."""


class ProfileError(NodeError):
    """A profile file or server argument list the launcher cannot use."""


class Clock(Protocol):
    """Time as the supervisor sees it; tests pass a fake that advances on `sleep`."""

    def now(self) -> float: ...

    def wall(self) -> float: ...

    async def sleep(self, seconds: float) -> None: ...


class SystemClock:
    """The real clock: monotonic for deadlines, wall time for the state file."""

    def now(self) -> float:
        return time.monotonic()

    def wall(self) -> float:
        return time.time()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


class ServerProcess(Protocol):
    """What the supervisor needs of a child process (a Popen, or a scripted fake)."""

    @property
    def pid(self) -> int: ...

    def poll(self) -> int | None: ...

    def terminate(self) -> None: ...

    def kill_group(self) -> None: ...


@dataclass(frozen=True)
class LaunchSpec:
    """Everything needed to (re)start one child: server (with a port) or worker (without)."""

    name: str
    argv: tuple[str, ...]
    env: Mapping[str, str]
    log_path: Path
    port: int | None = None
    host: str = HOST

    @property
    def url(self) -> str:
        """Base URL of the server's HTTP API."""
        host = HOST if self.host in ("0.0.0.0", "::", "") else self.host
        return f"http://{host}:{self.port}"


def split_flags(args: Sequence[str]) -> list[tuple[str | None, list[str]]]:
    """Group an argument list into (flag, tokens) items: `--x 1 2` and `--y=3` are one each."""
    items: list[tuple[str | None, list[str]]] = []
    for arg in args:
        if arg.startswith("--"):
            items.append((arg.partition("=")[0], [arg]))
        elif items:
            items[-1][1].append(arg)
        else:
            items.append((None, [arg]))
    return items


def flag_value(args: Sequence[str], *names: str) -> str | None:
    """The last value given for any of `names` (`--x v` or `--x=v`); "" for a bare flag."""
    value: str | None = None
    for flag, tokens in split_flags(args):
        if flag in names:
            _, eq, inline = tokens[0].partition("=")
            value = inline if eq else (tokens[1] if len(tokens) > 1 else "")
    return value


def redacted(argv: Sequence[str]) -> list[str]:
    """`argv` with secret values masked, for logs and the state file."""
    out = list(argv)
    for i, word in enumerate(out):
        name, eq, _ = word.partition("=")
        if name in SECRET_FLAGS:
            if eq:
                out[i] = f"{name}=***"
            elif i + 1 < len(out):
                out[i + 1] = "***"
    return out


def build_argv(command: Sequence[str], model: str | None, port: int, nccl_port: int,
               args: Sequence[str]) -> list[str]:
    """The server's full argv: entry point, model, ports, launcher defaults, then `args`."""
    for flag in ("--port", "--nccl-port", "--base-gpu-id"):
        if flag_value(args, flag) is not None:
            raise ProfileError(f"{flag} is set per GPU by the launcher (ports: --base-port); "
                               "remove it from the server arguments")
    for flags in (("--tp-size", "--tensor-parallel-size", "--tp"),
                  ("--dp-size", "--data-parallel-size", "--dp")):
        value = flag_value(args, *flags)
        if value not in (None, "1"):
            raise ProfileError(f"{flags[0]} {value}: the launcher runs one server per GPU, "
                               "so tensor and data parallelism must be 1")
    argv = list(command)
    if model and flag_value(args, "--model-path", "--model") is None:
        argv += ["--model-path", model]
    argv += ["--port", str(port), "--nccl-port", str(nccl_port)]
    # --log-level warning would hide the lines readiness and capacity are read from (§1).
    for flag, value in (("--host", HOST), ("--log-level", "info")):
        if flag_value(args, flag) is None:
            argv += [flag, value]
    if flag_value(args, "--enable-metrics") is None:
        argv.append("--enable-metrics")
    return argv + list(args)


class PopenProcess:
    """A real child in its own session; SIGTERM goes to the leader, SIGKILL to the group."""

    def __init__(self, popen: subprocess.Popen[bytes]) -> None:
        self.popen = popen

    @property
    def pid(self) -> int:
        return self.popen.pid

    def poll(self) -> int | None:
        return self.popen.poll()

    def terminate(self) -> None:
        # The leader only: SGLang's main process drains and then stops its schedulers itself,
        # and a Celery worker's warm shutdown needs its pool children alive (celery-redis X9).
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)

    def kill_group(self) -> None:
        try:
            os.killpg(self.popen.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass  # the whole group is already gone
        if self.popen.returncode is None:
            try:
                self.popen.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass  # a process in uninterruptible sleep; poll() reaps it later


def spawn(spec: LaunchSpec) -> PopenProcess:
    """Start `spec` with its output appended to its log after a launcher marker line.

    Raises PortBusyError when its port is taken: SGLang would find out only after loading
    the whole model (contract §1).
    """
    if spec.port is not None and not port_is_free(spec.port):
        raise PortBusyError(f"port {spec.port} is in use by another process")
    spec.log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(spec.log_path, "ab") as out:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        out.write(f"{MARKER} {stamp} starting {spec.name}: {' '.join(redacted(spec.argv))}\n".encode())
        out.flush()
        popen = subprocess.Popen(
            list(spec.argv), stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
            env=dict(spec.env), start_new_session=True,
            # A SIGKILLed launcher leaves its servers SIGTERMed (they drain), not orphaned.
            preexec_fn=die_with_parent,  # noqa: PLW1509 (two syscalls, no Python locks)
        )
    return PopenProcess(popen)


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
    effective: int | None  # per DP rank; workers size their concurrency from this
    binding: str | None
    reason: str

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
        return ", ".join(parts) + f" -- {self.reason}"


def read_server(info: Mapping[str, object] | None, report: LogReport) -> Reading:
    """Combine a `/server_info` body (None if it failed) with what the log said."""
    log = report.to_json()
    cap = report.capacity()
    server = from_server_info(info) if info is not None else None
    if server is not None and server.capacity.effective is not None:
        cap = server.capacity
    state = _first_state(info)
    memory = state.get("memory_usage")
    memory = memory if isinstance(memory, Mapping) else {}
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
                                as_int((info or {}).get("cuda_graph_max_bs_decode")),
                                as_int((info or {}).get("cuda_graph_max_bs"))),
        requested=cap.requested, effective=cap.effective, binding=cap.binding,
        reason=cap.reason,
    )


def _first_state(info: Mapping[str, object] | None) -> Mapping[str, object]:
    states = (info or {}).get("internal_states")
    first = states[0] if isinstance(states, list) and states else None
    return first if isinstance(first, Mapping) else {}


def _pick(*values: T | None) -> T | None:
    return next((v for v in values if v is not None), None)


def _v(value: object) -> str:
    return "-" if value is None else str(value)


async def stop_process(proc: ServerProcess, clock: Clock, timeout_s: float,
                       poll_s: float = 0.1) -> tuple[int | None, bool]:
    """SIGTERM the leader, wait up to `timeout_s`, then SIGKILL the group.

    The group is swept even after a clean exit: a child the leader left behind must not keep
    the GPU. Returns (exit code, whether SIGKILL was needed).
    """
    if proc.poll() is None:
        proc.terminate()
        deadline = clock.now() + timeout_s
        while proc.poll() is None and clock.now() < deadline:
            await clock.sleep(poll_s)
    killed = proc.poll() is None
    proc.kill_group()
    return proc.poll(), killed
